"""Single node vs 2- and 3-stage splits, through the real HTTP endpoint.

Every configuration runs in this one invocation, so the ratios compare like with like:
real node processes (own homes, real mDNS + QUIC), speculation off, the same llama.cpp
thread count on every stage. Placement: loopback (default), or with ``--netns`` every
node in a network namespace of its own on a bridge (:mod:`meshnode.bench.netns`: its own
address, 1500-byte MTU, real mDNS across the bridge; each configuration its own bridge);
without root that mode is refused with the reason. Also measured here: the ceiling for
concurrency, i.e. what the same engine reaches decoding one batch of B sessions directly
in-process, and where a one-stream decode token's time goes on each configuration,
marked by the nodes themselves (:mod:`meshnode.timeline`, :mod:`meshnode.bench.timeline`).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

from meshnode.bench.cluster import add_busy_poll_option, busy_poll_flags, sse_chunks
from meshnode.bench.timeline import TokenPath
from meshnode.argtypes import gpu_layers_flag, GPU_LAYERS_HELP, gpu_layers, non_negative_float, positive_int
from meshnode.limits import MAX_SEQ

HELP = "serving benchmark: single node vs 2/3-stage splits (decode, TTFT, prefill, concurrency)"

STORY = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."
LONG_PROMPT = ("Summarize the following notes in one sentence.\n" +
               "\n".join(f"- Note {i}: the meeting about topic {i} moved to room {i % 7}." for i in range(24)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF or store name (default: the default model)")
    p.add_argument("--big", action="store_true",
                   help="also run a random-weight ~1B llama (written once into the cache; slow)")
    p.add_argument("--stages", default="1,2,3", help="stage counts to run (default 1,2,3)")
    p.add_argument("--threads", type=positive_int, default=1, help="llama.cpp threads per stage (default 1)")
    p.add_argument("--gpu-layers", type=gpu_layers, default=-1, metavar="N|all|auto", help=GPU_LAYERS_HELP)
    p.add_argument("--cuda-devices", type=cuda_device_list, default=[], metavar="LIST",
                   help="GPUs for the nodes, e.g. 0,1: node i of each configuration sees only "
                        "device LIST[i mod len] (CUDA_VISIBLE_DEVICES), one node process per GPU "
                        "(default: every node sees every GPU)")
    add_busy_poll_option(p)
    p.add_argument("--pin", action="store_true",
                   help="give each node of a configuration CPUs of its own (--cpus), when the "
                        "machine has enough (default: the OS places them)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream (default 64)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="sampling temperature of the streams (default 0: greedy; seeded, so "
                        "every configuration samples the same text)")
    p.add_argument("--concurrency", default="1,4,8", help="concurrent streams (default 1,4,8)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="interleaved rounds over all configurations (default 3; medians reported)")
    p.add_argument("--netns", action="store_true",
                   help="every node in a network namespace of its own on a bridge (own address, "
                        "real mDNS; needs root) instead of loopback")
    p.add_argument("--quick", action="store_true", help="fewer tokens and rounds")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")


def cuda_device_list(text: str) -> list[str]:
    """``--cuda-devices``: comma-separated device numbers."""
    devs = [d.strip() for d in text.split(",")]
    if not all(d.isdigit() and int(d) < 64 for d in devs):
        raise argparse.ArgumentTypeError(f"want device numbers like 0,1, got {text!r}")
    return devs


def _device_env(devs: list[str], index: int) -> dict[str, str]:
    """The environment that gives node ``index`` its own GPU (``--cuda-devices``)."""
    return {"CUDA_VISIBLE_DEVICES": devs[index % len(devs)]} if devs else {}


class _Timeline:
    """A folder of marks for each node of each configuration (:mod:`meshnode.timeline`),
    the bench's one-stream runs as time windows, and the token path computed from both
    once the nodes stopped."""

    def __init__(self) -> None:
        import tempfile

        self.root: Path | None = Path(tempfile.mkdtemp(prefix="meshnode-timeline-"))
        self.windows: dict[int, list[tuple[int, int]]] = {}

    def env(self, n: int, index: int) -> dict[str, str]:
        from meshnode.timeline import ENV

        return {} if self.root is None else {ENV: str(self.root / str(n) / f"node{index}")}

    def window(self, n: int, t0: int, t1: int) -> None:
        self.windows.setdefault(n, []).append((t0, t1))

    def token_path(self, n: int, route: list[str]):
        """The median token path of configuration ``n`` (None without marks)."""
        from meshnode.bench.timeline import load_marks, token_path

        if self.root is None or len(route) != n:
            return None
        return token_path([load_marks(self.root / str(n) / name) for name in route], self.windows.get(n, ()))

    def close(self) -> None:
        import shutil

        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


def _stream(base: str, model: str, prompt: str, max_tokens: int, inside=None, temperature: float = 0.0) -> dict:
    """One streamed chat completion: TTFT, tokens, timings. ``inside``: a context manager
    putting this thread in the node's namespace (``--netns``) for the request."""
    import contextlib

    with (inside or contextlib.nullcontext)():
        return _stream_here(base, model, prompt, max_tokens, temperature)


def _stream_here(base: str, model: str, prompt: str, max_tokens: int, temperature: float) -> dict:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "seed": 1, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = t_first = None
    stamps: list[float] = []
    usage = timings = None
    with httpx.Client(timeout=600, trust_env=False) as c, c.stream("POST", f"{base}/chat/completions", json=body) as r:
        for chunk in sse_chunks(r):
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
                if ttft is None:
                    t_first = stamps[-1]
                    ttft = t_first - t0
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    return {"ttft_s": ttft, "wall_s": time.perf_counter() - t0, "t_first": t_first or t0, "stamps": stamps,
            "t_end": time.perf_counter(),
            "tokens": (usage or {}).get("completion_tokens", 0), "timings": timings or {}}


def _aggregate(base: str, model: str, inside, tokens: int, c: int, temperature: float) -> float:
    """Aggregate decode tokens/s of ``c`` concurrent streams in the steady state: text
    chunks (~tokens) that arrive while every stream is decoding, i.e. between the last
    stream's first token and the first stream's end, over that window."""
    with ThreadPoolExecutor(c) as ex:
        results = list(ex.map(lambda _: _stream(base, model, STORY, tokens, inside, temperature), range(c)))
    lo = max(r["t_first"] for r in results)
    hi = min(r["stamps"][-1] if r["stamps"] else r["t_end"] for r in results)
    n = sum(sum(1 for t in r["stamps"] if lo < t <= hi) for r in results)
    return n / (hi - lo) if hi > lo else 0.0


class _Ceiling:
    """The same engine decoding one batch of B sessions directly, in this process: what
    continuous batching could reach at best. Loaded once, measured in every round."""

    def __init__(self, model_path, threads: int, max_b: int, gpu_layers: int = 0) -> None:
        from meshnode.engine import EngineConfig, StageEngine

        self.engine = StageEngine(EngineConfig(model_path, n_ctx=256, n_batch=64, n_seq_max=max_b,
                                             n_threads=threads, gpu_layers=gpu_layers))

    def tok_s(self, b: int, steps: int = 16) -> float:
        import numpy as np

        from meshnode.engine import Segment

        eng = self.engine
        for s in range(b):
            eng.drop(s)
            eng.forward([Segment(s, 0, tokens=np.arange(1, 17, dtype=np.int32), n_logits=1)])
        times = []
        for k in range(steps):
            segs = [Segment(s, 16 + k, tokens=np.asarray([5 + s], dtype=np.int32), n_logits=1)
                    for s in range(b)]
            t0 = time.perf_counter()
            eng.forward(segs)
            times.append(time.perf_counter() - t0)
        for s in range(b):
            eng.drop(s)
        return b / statistics.median(times)

    def close(self) -> None:
        self.engine.close()


def _rotated(items: list, r: int) -> list:
    return items[r % len(items):] + items[:r % len(items)]


def _run_model(model_ref, args, stage_counts, concurrency) -> dict:
    """Every configuration is up at once and the rounds interleave them (order rotated
    each round), so a slow spell of this shared machine hits all of them alike. Ratios
    are paired: computed within a round, then the median over rounds."""
    marks = _Timeline()
    try:
        return _run_configs(model_ref, args, stage_counts, concurrency, marks)
    finally:
        marks.close()


def _run_configs(model_ref, args, stage_counts, concurrency, marks: "_Timeline") -> dict:
    import contextlib

    from meshnode.bench.cluster import LocalCluster, cpu_flags

    gl = ("--gpu-layers", gpu_layers_flag(args.gpu_layers),
          *busy_poll_flags(args))
    # every request prefilled in full: TTFT and prefill are measured cold, every round alike
    flags = (*gl, "--threads", str(args.threads), "--parallel", str(max(concurrency)), "--ctx", "1024",
             "--batch", "64", "--spec-mode", "off", "--prefix-cache", "0", "--model", str(model_ref.path))
    ends: dict[int, tuple] = {}
    coords = {}
    with contextlib.ExitStack() as stack:
        for n in stage_counts:
            print(f"  {model_ref.name}: starting {n} stage(s) ...", file=sys.stderr, flush=True)
            net = None
            if args.netns:
                from meshnode.bench.netns import Netns

                net = stack.enter_context(Netns(n))
            cluster = stack.enter_context(LocalCluster(model_ref.path, n, netns=net))
            for i in range(1, n):
                cluster.start(i, "--no-model", *gl, "--threads", str(args.threads), "--parallel",
                              str(max(concurrency)), *cpu_flags(i, n, args.threads, pin=args.pin),
                              env={**_device_env(args.cuda_devices, i), **marks.env(n, i)})
            coord = cluster.start(0, *flags, "--split", str(n),
                                  *cpu_flags(0, n, args.threads, pin=args.pin),
                                  env={**_device_env(args.cuda_devices, 0), **marks.env(n, 0)}).wait_model()
            ends[n] = (coord.base_url, coord.get("/v1/models")["data"][0]["id"], coord.inside)
            coords[n] = coord
        ceiling = _Ceiling(model_ref.path, args.threads, max(concurrency), args.gpu_layers)
        stack.callback(ceiling.close)
        stages = {n: _stages(coords[n]) for n in stage_counts}
        for base, model, inside in ends.values():
            _stream(base, model, "Hello", 4, inside)  # warm-up
        rounds: list[dict] = []
        for r in range(args.rounds):
            print(f"  {model_ref.name}: round {r + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
            got: dict = {"ceiling": {}}
            for n in _rotated(stage_counts, r):
                base, model, inside = ends[n]
                t0 = time.perf_counter_ns()
                one = _stream(base, model, STORY, args.tokens, inside, args.temperature)
                marks.window(n, t0, time.perf_counter_ns())
                pre = _stream(base, model, LONG_PROMPT, 1, inside)
                got[n] = {"decode_tok_s": one["timings"].get("predicted_per_second", 0.0),
                          "ttft_ms": 1e3 * (one["ttft_s"] or 0.0),
                          "prefill_tok_s": pre["timings"].get("prompt_per_second", 0.0),
                          "prefill_tokens": pre["timings"].get("prompt_n", 0), "aggregate_tok_s": {}}
            for c in concurrency:
                got["ceiling"][str(c)] = ceiling.tok_s(c)
                for n in _rotated(stage_counts, r):
                    got[n]["aggregate_tok_s"][str(c)] = _aggregate(*ends[n], args.tokens, c, args.temperature)
            rounds.append(got)
        stack.close()   # the nodes write their marks when they stop
    out = _summarize(rounds, stage_counts, concurrency)
    out["token_path"] = {}
    for n in stage_counts:
        tp = marks.token_path(n, [str(s.get("node") or "") for s in stages[n]])
        out["token_path"][str(n)] = {"layers": [s["layers"] for s in stages[n]],
                                     **(tp.as_dict() if tp is not None else {})}
    return out


def _stages(coord) -> list[dict]:
    """The coordinator's stages in stage order (/status; empty when it cannot tell)."""
    try:
        stages = coord.get("/status").get("stages") or []
    except (OSError, ValueError):
        return []
    return sorted(stages, key=lambda s: s["index"])


def _summarize(rounds: list[dict], stage_counts: list[int], concurrency: list[int]) -> dict:
    med = statistics.median
    base = stage_counts[0]
    out: dict = {"rounds": len(rounds),
                 "ceiling_tok_s": {str(c): med(g["ceiling"][str(c)] for g in rounds) for c in concurrency}}
    for n in stage_counts:
        res = {k: med(g[n][k] for g in rounds)
               for k in ("decode_tok_s", "ttft_ms", "prefill_tok_s", "prefill_tokens")}
        res["aggregate_tok_s"] = {str(c): med(g[n]["aggregate_tok_s"][str(c)] for g in rounds)
                                  for c in concurrency}
        ratios = [g[n]["decode_tok_s"] / g[base]["decode_tok_s"] if g[base]["decode_tok_s"] else 0.0
                  for g in rounds]
        res["decode_ratio"] = med(ratios)
        res["decode_ratio_range"] = [min(ratios), max(ratios)]
        res["aggregate_over_ceiling"] = {
            str(c): med(g[n]["aggregate_tok_s"][str(c)] / g["ceiling"][str(c)] for g in rounds)
            for c in concurrency}
        out[str(n)] = res
    return out


def _print(name: str, res: dict, stage_counts: list[int], concurrency: list[int]) -> None:
    base = stage_counts[0]
    print(f"\n{name}  (medians of {res['rounds']} interleaved rounds; ratios paired within a round,"
          f" against {base} stage(s))")
    print(f"{'stages':>6} {'decode tok/s':>13} {'ratio':>6} {'(min-max)':>11} {'TTFT ms':>8} "
          f"{'prefill tok/s':>14} " + " ".join(f"{'agg@' + str(c):>8}" for c in concurrency))
    for n in stage_counts:
        r = res[str(n)]
        lo, hi = r["decode_ratio_range"]
        print(f"{n:>6} {r['decode_tok_s']:>13.1f} {r['decode_ratio']:>6.2f} {f'{lo:.2f}-{hi:.2f}':>11} "
              f"{r['ttft_ms']:>8.0f} {r['prefill_tok_s']:>14.1f} "
              + " ".join(f"{r['aggregate_tok_s'][str(c)]:>8.1f}" for c in concurrency))
    ceil = res["ceiling_tok_s"]
    print("engine ceiling (one batch, in-process): " +
          ", ".join(f"B={c}: {ceil[str(c)]:.1f} tok/s" for c in concurrency))
    for n in stage_counts:
        r = res[str(n)]
        print(f"  {n} stage(s) aggregate / ceiling: " + ", ".join(
            f"@{c}: {r['aggregate_over_ceiling'][str(c)]:.2f}" for c in concurrency))
    paths = res.get("token_path") or {}
    print("where a one-stream decode token's time goes, marked in the nodes (sN = stage N; "
          "'hop to sN': from the sendto to sN's receive; us):")
    for n in stage_counts:
        t = paths.get(str(n)) or {}
        where = " ".join(f"s{i} [{a},{b})" for i, (a, b) in enumerate(t.get("layers") or []))
        print(f"  {n} stage(s) {where}: " + (TokenPath.from_dict(t).line() if "steps" in t else
                                               "no decode step marked (the fast lane was not used)"))


def run(args: argparse.Namespace) -> int:
    import os

    from meshnode.models.store import resolve_model
    from meshnode.paths import NodePaths

    if args.quick:
        args.tokens = min(args.tokens, 32)
        args.rounds = min(args.rounds, 2)
    if args.tokens < 2:
        print("meshnode bench serve: --tokens must be >= 2", file=sys.stderr)
        return 2
    try:
        stage_counts = [int(x) for x in args.stages.split(",")]
        concurrency = [int(x) for x in args.concurrency.split(",")]
    except ValueError:
        stage_counts = concurrency = []
    if not stage_counts or not concurrency or min(stage_counts + concurrency) < 1:
        print("meshnode bench serve: --stages and --concurrency take comma-separated positive "
              "integers, e.g. --stages 1,2 --concurrency 1,4", file=sys.stderr)
        return 2
    if max(concurrency) > MAX_SEQ:   # every node serves them at once (--parallel)
        print(f"meshnode bench serve: --concurrency takes at most {MAX_SEQ} streams", file=sys.stderr)
        return 2
    if args.cuda_devices:   # the in-process engines (ceiling, stage clocks) are one node: one GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = args.cuda_devices[0]
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per request
    if args.netns:
        from meshnode.bench.netns import unavailable

        why = unavailable()
        if why:
            print(f"meshnode bench serve: --netns is not available here: {why}", file=sys.stderr)
            return 2
    paths = NodePaths.resolve(args.home).ensure()
    place = "network namespaces on a bridge (own addresses, 1500-byte MTU)" if args.netns else "loopback"
    sampling = f"temperature {args.temperature:g} (seeded)" if args.temperature else "greedy"
    print(f"serve benchmark: {place}, {args.threads} thread(s) per stage, speculation off, {sampling}, "
          f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    out = {}
    ref = resolve_model(args.model, paths)
    out[ref.name] = _run_model(ref, args, stage_counts, concurrency)
    _print(ref.name, out[ref.name], stage_counts, concurrency)
    if args.big:
        from meshnode.models.store import model_ref_for_path
        from meshnode.models.synthetic import LLAMA_1B, write_synthetic_gguf

        big = paths.cache / "bench" / "random-llama-1b-f16.gguf"
        if not big.exists():
            print("writing a random-weight ~1B llama (once) ...", file=sys.stderr)
            write_synthetic_gguf(big, LLAMA_1B)
        bref = model_ref_for_path(big, paths)
        big_args = argparse.Namespace(**{**vars(args), "tokens": min(args.tokens, 16)})
        out[bref.name] = _run_model(bref, big_args, [n for n in stage_counts if n <= 2], [1])
        _print(bref.name, out[bref.name], [n for n in stage_counts if n <= 2], [1])
    if args.json:
        print(json.dumps(out))
    return 0
