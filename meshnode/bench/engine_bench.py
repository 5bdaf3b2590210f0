"""`meshnode bench engine`: the whole model against its chained slices, in one process.

Both paths run the same tokens through real llama.cpp engines with the same batch
schedule: the whole model as one :class:`~meshnode.engine.StageEngine`, and the slices
for ``--splits`` chained the way the pipeline chains them (stage i's hidden states fed to
stage i+1 through ``forward()``), with no network in between. So the ratio is the cost
of slicing itself: graph stops, the ``cb_eval`` capture, hidden-state copies, one
llama_decode per stage instead of one in all.

- decode: after a short prompt, ``--tokens`` single-token steps (greedy tokens of the
  whole model, fed to both paths); the two paths alternate token by token, and which goes
  first alternates too, so machine load drifts hit both alike. Median ms/token after
  ``--warmup`` steps.
- idle gap: the whole model again, alternating a step right after the previous one with
  a step after ``--gap-ms`` of sleep. A pipeline stage waits for the other stages between
  its steps; on a machine whose cores lose their warm state while idle that wait would
  make the stage's own compute slower, which no network optimisation can win back (on
  a 2-core VM it measured 1.02x).
- prefill: a ``--prefill``-token prompt fed in chunks of ``--batch`` rows, ``--reps``
  times per path (chunk by chunk, alternating which path goes first), median tokens/s.
- verify windows: on the whole model, with the ``--prefill`` tokens cached, one call of
  ``k`` rows for each ``k`` of ``--windows`` (logits for every row, as a verify window
  asks), rolled back after each, median of ``--reps``; reported in ms and in one-row
  steps. Speculation's gain is bounded by this curve: a window of ``k`` rows that is
  accepted whole yields ``k`` tokens for ``cost(k)`` plus one round trip of the route,
  so where ``cost(k)`` grows like ``k`` (a CPU computing every row) drafts only save the
  round trips (docs/speculative.md).

- adaptive threads (``--adapt``): decode on a second copy of the whole model whose
  thread count adapts to the cores the machine has free (engine/threads.py), alternating
  token by token with the whole model at the fixed ``--threads`` (every other section
  keeps its count fixed). With ``--load`` it shows what adapting wins on a busy
  machine; without, what its tries cost on an idle one.

Per-stage medians show where the chain's time goes. The last line with ``--json`` is one
JSON object.
"""

from __future__ import annotations

import argparse

HELP = "decode ms/token and prefill tokens/s: whole model vs chained slices in one process"

TEXT = (
    "Pipeline parallelism splits a transformer into contiguous ranges of layers. Each "
    "machine keeps its own key-value cache and forwards the residual stream to the next. "
)


def window_sizes(text: str) -> list[int]:
    """``--windows``: distinct row counts in 1..MAX_VERIFY_WINDOW, in order; 'none' is []."""
    from meshnode.limits import MAX_VERIFY_WINDOW

    if text.strip().lower() == "none":
        return []
    try:
        ks = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated row counts or 'none', got {text!r}") from None
    if any(not 1 <= k <= MAX_VERIFY_WINDOW for k in ks):
        raise argparse.ArgumentTypeError(f"row counts in 1..{MAX_VERIFY_WINDOW}, got {text!r}")
    return sorted(set(ks))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from meshnode.argtypes import GPU_LAYERS_HELP, gpu_layers, non_negative_float, non_negative_int, positive_int

    parser.add_argument("model", nargs="?", default=None,
                        help="a GGUF path or a model name in the store (default: the default model)")
    parser.add_argument("--splits", default="10,20", metavar="L1,L2,...",
                        help="layers where a new stage starts (default 10,20: three stages)")
    parser.add_argument("--tokens", type=int, default=64, help="decode steps measured (default 64)")
    parser.add_argument("--warmup", type=int, default=8, help="decode steps not measured (default 8)")
    parser.add_argument("--prefill", type=int, default=256, help="prompt tokens for prefill (default 256)")
    parser.add_argument("--batch", type=int, default=64,
                        help="rows per llama_decode, the prefill chunk (default 64)")
    parser.add_argument("--reps", type=int, default=5, help="prefill repetitions per path (default 5)")
    parser.add_argument("--threads", type=positive_int, default=None, help="llama.cpp threads (default: all cores)")
    parser.add_argument("--gpu-layers", type=gpu_layers, default=-1, metavar="N|all|auto", help=GPU_LAYERS_HELP)
    parser.add_argument("--windows", type=window_sizes, default=[1, 2, 4, 8], metavar="K,K,...",
                        help="verify-window sizes (rows) timed on the whole model after the prefill "
                             "(default 1,2,4,8; 'none' skips it)")
    parser.add_argument("--gap-ms", type=non_negative_float, default=12.0, metavar="MS",
                        help="idle gap before every other step of the idle-gap measurement "
                             "(default 12: a 2-stage SmolLM2 split's wait; 0 skips it)")
    parser.add_argument("--load", type=non_negative_int, default=0, metavar="N",
                        help="keep N other processes busy (one core each) while measuring: a node's "
                             "speed while its machine does other work (default 0)")
    parser.add_argument("--adapt", action="store_true",
                        help="also decode with an engine whose thread count adapts to the free cores, "
                             "against the fixed --threads in the same run")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")


def busy_processes(n: int) -> list:
    """``n`` processes that each keep a core busy (a build, a browser tab); end them with
    :func:`end_processes`."""
    import os
    import subprocess
    import sys

    # (each one stops by itself once this process is gone, killed by a timeout or not)
    spin = "import os, sys\nwhile os.getppid() == int(sys.argv[1]): pass"
    return [subprocess.Popen([sys.executable, "-c", spin, str(os.getpid())]) for _ in range(n)]


def end_processes(procs: list) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def run(args: argparse.Namespace) -> int:
    import json
    import os
    import time

    import numpy as np

    from meshnode.certify import parse_splits
    from meshnode.engine import EngineConfig, Segment, StageEngine
    from meshnode.engine.stage import default_threads
    from meshnode.engine.tokenizer import Tokenizer
    from meshnode.errors import MeshnodeError
    from meshnode.models.slicer import SliceCache
    from meshnode.models.store import resolve_model
    from meshnode.paths import NodePaths

    if args.tokens < 1 or args.prefill < 1 or args.batch < 1 or args.reps < 1 or args.warmup < 0:
        raise MeshnodeError("--tokens, --prefill, --batch and --reps must be positive")
    windows = args.windows
    paths = NodePaths.resolve(args.home).ensure()
    ref = resolve_model(args.model, paths)
    splits = parse_splits(args.splits, ref.n_layers)
    cache = SliceCache(paths)
    bounds = [0, *splits, ref.n_layers]
    ranges = list(zip(bounds[:-1], bounds[1:]))
    slice_paths = [cache.get(ref, a, b) for a, b in ranges]
    threads = args.threads or default_threads()

    tok = Tokenizer(ref.path)
    text_ids = tok.encode(TEXT * 64, add_bos=True)
    tok.close()
    if len(text_ids) < args.prefill + 32:
        raise MeshnodeError(f"the benchmark text is only {len(text_ids)} tokens for this model")
    prefill_ids = np.asarray(text_ids[: args.prefill], dtype=np.int32)
    window_ids = np.asarray(text_ids[args.prefill: args.prefill + max(windows, default=0)], dtype=np.int32)
    prompt_ids = np.asarray(text_ids[:32], dtype=np.int32)

    n_ctx = max(args.prefill + max(windows, default=0), 32 + args.warmup + 2 * args.tokens) + 8
    common = dict(n_ctx=n_ctx, n_batch=args.batch, n_seq_max=1, n_threads=threads, gpu_layers=args.gpu_layers,
                  adapt_threads=False)
    whole = StageEngine(EngineConfig(ref.path, **common))
    adaptive = StageEngine(EngineConfig(ref.path, **{**common, "adapt_threads": True})) if args.adapt else None
    stages = [
        StageEngine(EngineConfig(p, takes_tokens=(i == 0), has_head=(i == len(ranges) - 1), **common))
        for i, p in enumerate(slice_paths)
    ]
    stage_times: list[list[float]] = [[] for _ in stages]

    def chain_forward(pos: int, rows: np.ndarray, n_logits: int, record: bool) -> np.ndarray:
        h: np.ndarray | None = None
        for i, eng in enumerate(stages):
            seg = (Segment(0, pos, tokens=rows, n_logits=0) if i == 0
                   else Segment(0, pos, hidden=h, n_logits=n_logits if eng.has_head else 0))
            t0 = time.perf_counter()
            h = eng.forward([seg])[0]
            if record:
                stage_times[i].append(time.perf_counter() - t0)
        assert h is not None
        return h

    def forward_on(eng: StageEngine):
        def forward(pos: int, rows: np.ndarray, n_logits: int, record: bool) -> np.ndarray:
            return eng.forward([Segment(0, pos, tokens=rows, n_logits=n_logits)])[0]
        return forward

    whole_forward = forward_on(whole)
    paths_fwd = {"whole": whole_forward, "chain": chain_forward}
    if adaptive is not None:
        paths_fwd["adaptive"] = forward_on(adaptive)
    threads_used: list[int] = []

    load = busy_processes(args.load)
    try:
        # ---- decode ------------------------------------------------------------------
        decode: dict[str, list[float]] = {name: [] for name in paths_fwd}
        logits = {name: fwd(0, prompt_ids, 1, False) for name, fwd in paths_fwd.items()}
        exact = all(np.array_equal(logits["whole"], v) for v in logits.values())
        nxt = int(logits["whole"][-1].argmax())
        pos = len(prompt_ids)
        for step in range(args.warmup + args.tokens):
            measured = step >= args.warmup
            order = list(paths_fwd) if step % 2 == 0 else list(paths_fwd)[::-1]
            row = np.asarray([nxt], dtype=np.int32)
            for name in order:
                t0 = time.perf_counter()
                logits[name] = paths_fwd[name](pos, row, 1, measured)
                if measured:
                    decode[name].append(time.perf_counter() - t0)
            if adaptive is not None and measured:
                threads_used.append(adaptive.threads)
            exact = exact and all(np.array_equal(logits["whole"], v) for v in logits.values())
            nxt = int(logits["whole"][-1].argmax())
            pos += 1
        decode_stage_ms = [1000 * float(np.median(t)) for t in stage_times]

        # ---- idle gap ----------------------------------------------------------------
        gap: dict[str, list[float]] = {"back_to_back": [], "after_gap": []}
        for step in range(args.tokens if args.gap_ms > 0 else 0):
            kind = "after_gap" if step % 2 else "back_to_back"
            if kind == "after_gap":
                time.sleep(args.gap_ms / 1000)
            t0 = time.perf_counter()
            out = whole_forward(pos, np.asarray([nxt], dtype=np.int32), 1, False)
            gap[kind].append(time.perf_counter() - t0)
            nxt = int(out[-1].argmax())
            pos += 1

        # ---- prefill -----------------------------------------------------------------
        for t in stage_times:
            t.clear()
        prefill: dict[str, list[float]] = {"whole": [], "chain": []}
        for rep in range(args.reps + 1):  # the first repetition warms caches up
            for eng in (whole, *stages):
                eng.rollback(0, 0)
            spent = {"whole": 0.0, "chain": 0.0}
            for k, start in enumerate(range(0, args.prefill, args.batch)):
                chunk = prefill_ids[start:start + args.batch]
                n_logits = 1 if start + args.batch >= args.prefill else 0
                # Chunk by chunk, alternating which path goes first: drift hits both alike.
                for name in (("whole", "chain") if (rep + k) % 2 == 0 else ("chain", "whole")):
                    t0 = time.perf_counter()
                    paths_fwd[name](start, chunk, n_logits, rep > 0)
                    spent[name] += time.perf_counter() - t0
            if rep > 0:
                for name, t in spent.items():
                    prefill[name].append(t)
        prefill_stage_s = [float(np.sum(t)) / args.reps for t in stage_times]

        # ---- verify windows (the whole model holds the prefill) ----------------------
        window_s: dict[int, list[float]] = {k: [] for k in windows}
        for rep in range(args.reps + 1):  # the first repetition warms up
            for k in (windows if rep % 2 == 0 else windows[::-1]):
                t0 = time.perf_counter()
                whole_forward(args.prefill, window_ids[:k], k, False)
                if rep > 0:
                    window_s[k].append(time.perf_counter() - t0)
                whole.rollback(0, args.prefill)
    finally:
        end_processes(load)
        whole.close()
        if adaptive is not None:
            adaptive.close()
        for eng in stages:
            eng.close()

    dec = {k: 1000 * float(np.median(v)) for k, v in decode.items()}
    pre = {k: args.prefill / float(np.median(v)) for k, v in prefill.items()}
    idle = ({k: 1000 * float(np.median(v)) for k, v in gap.items()} if gap["after_gap"] else None)
    win_ms = {k: 1000 * float(np.median(v)) for k, v in window_s.items()}
    one_row = win_ms.get(1)
    result = {
        "model": ref.name,
        "n_layers": ref.n_layers,
        "splits": splits,
        "threads": threads,
        "batch": args.batch,
        "tokens": args.tokens,
        "prefill_tokens": args.prefill,
        "loadavg": list(os.getloadavg()),
        "busy_processes": args.load,
        "decode_ms_per_token": {**dec, "ratio": dec["chain"] / dec["whole"]},
        "adaptive_threads": None if adaptive is None else {
            "ms_per_token": dec["adaptive"], "ratio": dec["adaptive"] / dec["whole"],
            "threads_used": {str(n): threads_used.count(n) for n in sorted(set(threads_used))}},
        "prefill_tokens_per_s": {**pre, "ratio": pre["chain"] / pre["whole"]},
        "decode_stage_ms": decode_stage_ms,
        "prefill_stage_ms_per_chunk": [
            1000 * s / -(-args.prefill // args.batch) for s in prefill_stage_s],
        "chain_logits_identical": exact,
        "verify_window_ms": {str(k): v for k, v in win_ms.items()},
        "verify_window_context": args.prefill,
        "idle_gap": None if idle is None else {
            "gap_ms": args.gap_ms, **idle, "ratio": idle["after_gap"] / idle["back_to_back"]},
    }

    names = [f"[{a},{b})" for a, b in ranges]
    print(f"meshnode bench engine: {ref.name} ({ref.n_layers} layers), stages {' '.join(names)}, "
          f"{threads} thread(s), batch {args.batch}"
          + (f", {args.load} other busy process(es)" if args.load else ""))
    print(f"  {'':<22} {'whole':>10} {'chain':>10} {'chain/whole':>12}")
    print(f"  {'decode ms/token':<22} {dec['whole']:>10.2f} {dec['chain']:>10.2f} "
          f"{result['decode_ms_per_token']['ratio']:>12.3f}")
    print(f"  {'prefill tokens/s':<22} {pre['whole']:>10.1f} {pre['chain']:>10.1f} "
          f"{result['prefill_tokens_per_s']['ratio']:>12.3f}")
    print("  per stage: decode ms/token " + ", ".join(
        f"{n} {t:.2f}" for n, t in zip(names, decode_stage_ms)))
    print("             prefill ms/chunk " + ", ".join(
        f"{n} {t:.1f}" for n, t in zip(names, result["prefill_stage_ms_per_chunk"])))
    if adaptive is not None:
        ad = result["adaptive_threads"]
        print(f"  whole model, adaptive threads: {dec['adaptive']:.2f} ms/token against {dec['whole']:.2f} "
              f"with {threads} fixed ({ad['ratio']:.3f}x); steps by settled thread count: "
              + ", ".join(f"{n}: {c}" for n, c in ad["threads_used"].items()))
    if idle is not None:
        print(f"  whole model, one step after {args.gap_ms:g} ms idle: {idle['after_gap']:.2f} ms against "
              f"{idle['back_to_back']:.2f} right after the previous one "
              f"({result['idle_gap']['ratio']:.2f}x)")
    if win_ms:
        print(f"  verify windows, whole model, {args.prefill} tokens cached: " + ", ".join(
            f"{k} row{'s' if k > 1 else ''} {ms:.1f} ms" + (f" ({ms / one_row:.2f} steps)" if one_row and k != 1 else "")
            for k, ms in win_ms.items()))
    print(f"  decode logits identical on {'every path' if adaptive is not None else 'both paths'}: "
          f"{'yes' if exact else 'NO'}; "
          f"load average {' '.join(f'{x:.2f}' for x in result['loadavg'])}")
    if args.json:
        print(json.dumps(result))
    return 0
