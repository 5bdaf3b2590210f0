"""Speculative decoding over a 2-stage split with emulated LAN latency, by wall clock.

Topology (all on this machine, real node processes with their own homes)::

    coordinator A (stage 0) --QUIC--> UdpDelayRelay (+delay each way) --> node B (stage 1)

B runs with ``--no-discovery --quic-port P``; the relay listens on R and forwards to P;
A runs with ``--no-discovery --peer R --split 2``, so every packet between the stages
crosses the relay. Kernels without netem are common (docs/testing.md), so the relay is
the latency emulation; the output says so. ``--netns``: A and B run in network
namespaces of their own on a bridge (:mod:`meshnode.bench.netns`, 1500-byte MTU, each
its own address), the relay in A's namespace forwarding to B's address, so the stages'
packets cross a real link; without root that mode is refused with the reason.

Strategies, each on a split of its own (all up for the whole run): ``baseline``
(``--spec-mode off``), ``ngram_auto`` (``--spec ngram --spec-mode auto``) and ``draft``
(``--draft-model D``, where D is the target requantized to Q4_0 with llama.cpp's
quantizer, or with ``--draft-layers N`` its first N layers plus the head; made once and
cached). Workloads and prompts: the prompt sets of :mod:`meshnode.bench.prompt_sets`
(``code_edit``: files of 50-210 lines with edits of seven kinds, editor sequences
included; ``mixed_chat``: questions, stories, summaries, multi-turn chats), the half
``--set`` names (default ``heldout``). Every prompt is answered by every strategy back
to back, in an order rotated per prompt and round, so the machine's drift hits the
strategies alike (on this shared VM a plain step's speed moves by 5-10% over minutes).
Each request carries an API key of its own per round (``r<round>-<prompt>``), one per
editor sequence, so a node's recent-texts proposer drafts only from what a real client
would have sent before (never from the same prompt's earlier round).

Requests are streamed. What the user feels: **wall-clock tokens/s** (completion tokens
over the request's whole time, prefill included; per prompt the fastest round, then
total tokens over total seconds) and **time to first token** (median over prompts);
``wall x`` is the wall-clock speedup against that workload's baseline in the same
invocation, also per kind of prompt. Beside it, the server's decode tokens/s
(``timings.predicted_n`` over ``predicted_ms``, summed over prompts, and its speedup), acceptance
``sum(draft_n_accepted) / sum(draft_n)``, and where the time went, from the responses'
``timings`` summed over every round: verify windows and their mean time, plain
(one-token) steps and theirs, lookahead windows used / sent. Greedy decoding throughout,
so every strategy must produce the same text (checked and reported).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from meshnode.bench.cluster import add_busy_poll_option, busy_poll_flags, sse_chunks
from meshnode.argtypes import (
    draft_window, gpu_layers_flag, GPU_LAYERS_HELP, gpu_layers, non_negative_float, positive_float, positive_int,
)

HELP = "speculative decoding benchmark: baseline vs n-gram auto vs draft model on a 2-stage split"

STRATEGIES = ("baseline", "ngram_auto", "draft")
WORKLOADS = ("code_edit", "mixed_chat")

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF or store name (default: the default model)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="llama.cpp threads per stage (default 1)")
    p.add_argument("--decode-threads", type=positive_int, default=None, metavar="N",
                   help="llama.cpp threads for one-token steps on every node (default: --threads; "
                        "1 keeps speculation token-identical when --threads > 1)")
    p.add_argument("--gpu-layers", type=gpu_layers, default=-1, metavar="N|all|auto", help=GPU_LAYERS_HELP)
    p.add_argument("--draft-max", type=draft_window, default=None, metavar="N",
                   help="largest verify window on every node (default: the node's, 32)")
    add_busy_poll_option(p)
    p.add_argument("--pin", action="store_true",
                   help="give each node CPUs of its own (--cpus), when the machine has enough "
                        "(default: the OS places them)")
    p.add_argument("--delay-ms", type=non_negative_float, default=5.0,
                   help="latency added by the relay, each way (default 5 ms)")
    p.add_argument("--tokens", type=positive_int, default=None,
                   help="max tokens per completion (default 160, --quick 96)")
    p.add_argument("--ctx", type=positive_int, default=4096,
                   help="context per node (default 4096: the longest prompt is ~2600 tokens)")
    p.add_argument("--prompts", type=positive_int, default=None,
                   help="prompts per workload, an editor sequence counting as one (default: all "
                        "of the --set, --quick its quick subset)")
    p.add_argument("--set", dest="split", choices=("tune", "heldout", "all"), default="heldout",
                   help="which half of the prompt sets: tune (what settings are settled on), "
                        "heldout (what is reported) or all (default heldout)")
    p.add_argument("--netns", action="store_true",
                   help="run the stages in network namespaces of their own on a bridge (each its "
                        "own address; needs root), the relay in the coordinator's namespace")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated subset of {','.join(STRATEGIES)}")
    p.add_argument("--draft-quant", default="Q4_0", type=_quant_type,
                   help="quantization of the derived draft model (default Q4_0)")
    p.add_argument("--draft-layers", type=positive_int, default=None, metavar="N",
                   help="derive the draft from the target's first N layers plus its output "
                        "norm and head (an early exit), at --draft-quant; default: every layer")
    p.add_argument("--target-quant", default=None, metavar="TYPE", type=_quant_type,
                   help="serve a copy of the model requantized to TYPE (made once, cached); "
                        "default: as is. F16 makes verify rows cheap on CPUs without AVX2 but "
                        "is not batch-invariant there (see docs/speculative.md)")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="rounds over all strategies; per prompt the fastest round counts "
                        "(default 3, --quick 2)")
    p.add_argument("--repetition-penalty", type=_penalty, default=None, metavar="R",
                   help="every request's repetition_penalty (over the whole context; default: "
                        "none): the penalized steps' speed, and speculation's text against "
                        "plain decoding's with it")
    p.add_argument("--quick", action="store_true", help="fewer prompts, tokens and rounds (a few minutes)")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")


def _penalty(text: str) -> float:
    """argparse type: a repetition penalty, above 0 and at most the endpoint's limit."""
    from meshnode.limits import MAX_REPEAT_PENALTY

    value = positive_float(text)
    if value > MAX_REPEAT_PENALTY:
        raise argparse.ArgumentTypeError(f"{text}: a repetition penalty is at most {MAX_REPEAT_PENALTY:g}")
    return value


def _quant_type(name: str) -> str:
    """argparse type: a llama.cpp quantization name (checked here, before any work; the
    engine is imported only when the option is given)."""
    from meshnode.engine.quantize import quant_type_name

    try:
        return quant_type_name(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ---- the relay, in a thread of its own (the benchmark itself blocks on HTTP) ----------


class _RelayThread:
    """The relay on a thread of its own, in namespace ``netns_index`` of ``net`` when given
    (listening on ``listen``, forwarding to ``target``)."""

    def __init__(self, target: tuple[str, int], delay_s: float, *, listen: str = "127.0.0.1",
                 net=None, netns_index: int = 0) -> None:
        import asyncio
        import threading

        from meshnode.bench.relay import UdpDelayRelay

        self._loop = asyncio.new_event_loop()
        self.relay = UdpDelayRelay((listen, 0), target, delay_s)

        def serve() -> None:
            with contextlib.nullcontext() if net is None else net.inside(netns_index):
                self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="relay", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.relay.start(), self._loop).result(10)

    @property
    def port(self) -> int:
        return self.relay.port

    def stop(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.relay.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


# ---- one completion -----------------------------------------------------------------


def _complete(base: str, model: str, messages: list[dict], max_tokens: int, key: str,
              inside=contextlib.nullcontext, extra: dict | None = None) -> dict:
    """One streamed chat completion as a client sees it: text, tokens, the server's
    ``timings``, time to first token and the whole request's wall time. ``extra``: more
    fields of the body (a repetition penalty)."""
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    parts: list[str] = []
    usage = timings = None
    ttft = None
    # --netns: the node's HTTP endpoint is on its namespace's loopback; this thread
    # works in there for the request (sockets are made when it connects)
    with inside(), httpx.Client(timeout=600, trust_env=False) as client:   # loopback: no proxy
        t0 = time.perf_counter()
        with client.stream("POST", f"{base}/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as r:
            for chunk in sse_chunks(r):
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(chunk["choices"][0]["delta"]["content"])
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
        wall = time.perf_counter() - t0
    return {"text": "".join(parts), "tokens": (usage or {}).get("completion_tokens", 0),
            "timings": timings or {}, "ttft_s": ttft if ttft is not None else wall, "wall_s": wall}


def _rate(runs: list[dict]) -> float:
    """The server's decode tokens/s over ``runs``: their tokens over their decode time."""
    ms = sum(r["timings"].get("predicted_ms", 0.0) for r in runs)
    return 1e3 * sum(r["timings"].get("predicted_n", 0) for r in runs) / ms if ms > 0 else 0.0


def _summary(runs_by_prompt: list[list[dict]]) -> dict:
    """Per prompt, the fastest of its rounds; then over prompts.

    Other processes on a shared machine only ever slow a run down, so the fastest round
    is the least disturbed one (by decode rate for the server's figure, by wall time for
    the client's). Draft counters are summed over every round.
    """
    best = [max(rs, key=lambda r: r["timings"].get("predicted_per_second", 0.0)) for rs in runs_by_prompt]
    fastest = [min(rs, key=lambda r: r["wall_s"]) for rs in runs_by_prompt]
    every = [r for rs in runs_by_prompt for r in rs]
    def total(key: str) -> float:
        return sum(r["timings"].get(key, 0) for r in every)

    draft_n, accepted, windows, plain, ahead, ahead_used, m_windows, m_n, m_accepted = (total(k) for k in (
        "draft_n", "draft_n_accepted", "draft_windows", "plain_steps", "draft_lookahead",
        "draft_lookahead_used", "draft_model_windows", "draft_model_n", "draft_model_n_accepted"))
    verify_ms = total("draft_verify_ms")
    # decode time not spent verifying is plain steps (plus the per-token bookkeeping)
    plain_ms = total("predicted_ms") - verify_ms
    wall_s = sum(r["wall_s"] for r in fastest)
    return {
        # total decoded tokens over total decode time: a mean of per-prompt rates would
        # weigh a short answer's rate as much as a long one's
        "tok_s": _rate(best),
        "wall_tok_s": sum(r["tokens"] for r in fastest) / wall_s if wall_s else 0.0,
        "wall_s": wall_s,
        "ttft_ms": 1e3 * statistics.median(r["ttft_s"] for r in fastest),
        "acceptance": accepted / draft_n if draft_n else 0.0,
        "draft_n": int(draft_n),
        "draft_n_accepted": int(accepted),
        "windows": int(windows),
        "accepted_per_window": accepted / windows if windows else 0.0,
        "ms_per_window": verify_ms / windows if windows else 0.0,
        "plain_steps": int(plain),
        "ms_per_plain_step": plain_ms / plain if plain else 0.0,
        "lookahead": int(ahead),
        "lookahead_used": int(ahead_used),
        # the windows the draft model drafted (a draft strategy drafts n-gram first)
        "model_windows": int(m_windows), "model_drafts": int(m_n), "model_accepted": int(m_accepted),
        "tokens": sum(r["tokens"] for r in best),
        "texts": [r["text"] for r in best],
        "stable": all(len({r["text"] for r in rs}) == 1 for rs in runs_by_prompt),
    }


def _differences(raw: dict, strategies: list[str]) -> list[str]:
    """Where a run's text left the first baseline run's (greedy output must not move):
    one line per differing run, with the first differing character and its context."""
    lines = []
    for w, by_strategy in raw.items():
        ref_runs = by_strategy.get("baseline") or by_strategy[strategies[0]]
        for s in strategies:
            for i, runs in enumerate(by_strategy[s]):
                ref = ref_runs[i][0]["text"]
                for rnd, r in enumerate(runs):
                    text = r["text"]
                    if text == ref:
                        continue
                    at = next((j for j, (a, b) in enumerate(zip(ref, text)) if a != b),
                              min(len(ref), len(text)))
                    lines.append(f"  text differs: {w} prompt {i + 1}, {s} round {rnd + 1}, "
                                 f"char {at}: {ref[max(0, at - 30):at + 30]!r} -> "
                                 f"{text[max(0, at - 30):at + 30]!r}")
    return lines


# ---- the run ------------------------------------------------------------------------


def derived_model(ref, paths, quant: str, role: str, n_layers: int | None = None):
    """``ref``'s model requantized to ``quant`` (made once into the cache), cut to its
    first ``n_layers`` blocks plus head when given (also once), vocab checked."""
    from meshnode.spec.derive import requantize, truncate_layers
    from meshnode.spec.draft import check_vocab

    dest = paths.cache / "bench" / f"{ref.path.stem}-{role}-{quant}.gguf"
    if not dest.exists():
        print(f"deriving a {role}: {ref.path.name} requantized to {quant} (once) ...",
              file=sys.stderr, flush=True)
        requantize(ref.path, dest, quant)
    if n_layers is not None:
        full, dest = dest, dest.with_name(f"{dest.stem}-first{n_layers}.gguf")
        if not dest.exists():
            print(f"deriving a {role}: its first {n_layers} of {ref.n_layers} layers plus the "
                  f"head (once) ...", file=sys.stderr, flush=True)
            truncate_layers(full, dest, n_layers)
    check_vocab(ref.path, dest)
    return dest


def _strategy_flags(name: str, draft_path) -> tuple[str, ...]:
    if name == "baseline":
        return ("--spec-mode", "off")
    if name == "ngram_auto":
        return ("--spec", "ngram", "--spec-mode", "auto")
    if name == "draft":
        return ("--draft-model", str(draft_path))
    raise ValueError(f"unknown strategy {name!r}")


def add_split_arguments(p: argparse.ArgumentParser) -> None:
    """The options of a benchmark that runs its splits as :func:`_start_split` does
    (``bench prefix``, ``bench score``)."""
    p.add_argument("--model", default=None, help="GGUF or store name (default: the default model)")
    p.add_argument("--threads", type=positive_int, default=1, help="llama.cpp threads per stage (default 1)")
    p.add_argument("--delay-ms", type=non_negative_float, default=5.0, help="latency added by the relay, each way (default 5 ms)")
    p.add_argument("--ctx", type=positive_int, default=4096, help="context per request (default 4096)")
    p.add_argument("--gpu-layers", type=gpu_layers, default=-1, metavar="N|all|auto", help=GPU_LAYERS_HELP)
    add_busy_poll_option(p)


def split_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The ``meshnode serve`` flags of :func:`add_split_arguments`' options, every node's."""
    return ("--threads", str(args.threads), "--ctx", str(args.ctx),
            "--gpu-layers", gpu_layers_flag(args.gpu_layers), *busy_poll_flags(args))


def _start_split(stack: contextlib.ExitStack, strategy: str, target, draft_path, common: tuple,
                 args: argparse.Namespace, net=None) -> tuple[str, str, _RelayThread, object]:
    """One 2-stage split serving ``strategy``: stage 1, the relay in front of it, and a
    warmed-up coordinator; all torn down by ``stack``. ``net``: each node in a namespace
    of its own (node 0 in namespace 0, node 1 in 1), the relay in namespace 0.
    Returns (base URL, model, relay, coordinator)."""
    from meshnode.bench.cluster import LocalCluster, cpu_flags, free_udp_port

    print(f"  starting the {strategy} split ...", file=sys.stderr, flush=True)
    cluster = stack.enter_context(LocalCluster(target, 2, netns=net))
    quic_port = free_udp_port()   # free here; a fresh namespace has every port free
    cluster.start(1, "--no-model", "--no-discovery", "--quic-port", str(quic_port), *common,
                  *cpu_flags(1, 2, args.threads, pin=args.pin))
    if net is None:
        relay = _RelayThread(("127.0.0.1", quic_port), args.delay_ms / 1000.0)
    else:
        relay = _RelayThread((net.ip(1), quic_port), args.delay_ms / 1000.0, listen=net.ip(0), net=net)
    stack.callback(relay.stop)
    peer = f"{'127.0.0.1' if net is None else net.ip(0)}:{relay.port}"
    coord = cluster.start(0, "--no-discovery", "--peer", peer, "--split", "2",
                          "--model", str(target), *common, *_strategy_flags(strategy, draft_path),
                          *cpu_flags(0, 2, args.threads, pin=args.pin)).wait_model()
    if strategy == "draft" and "serving without it" in coord.log_tail(100_000):
        print("  warning: the draft model was disabled (see the node log)", file=sys.stderr)
    model = coord.get("/v1/models")["data"][0]["id"]
    _complete(coord.base_url, model, [{"role": "user", "content": "Hello"}], 4, "warm-up",
              coord.inside)
    return coord.base_url, model, relay, coord


def _call_shapes(coord) -> list[str]:
    """What the split's GPU engines timed at load and chose (engine/callshape.py), from
    its nodes' logs: none on a CPU."""
    lines = []
    for path in sorted(coord.home.parent.glob("node*/node.log")):
        for line in path.read_text(errors="replace").splitlines():
            if "call shapes on" in line:
                lines.append(f"{path.parent.name}: {line.split(': ', 1)[-1].strip()}")
    return lines


def _learned_costs(coord) -> str:
    """What the coordinator sized its windows by at the end of the run (``/status``): the
    learned milliseconds of a step per window and the acceptance estimate."""
    try:
        spec = coord.get("/status")["spec"][0]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        return f"learned step cost: not read ({exc})"
    from meshnode.state import format_step_costs

    return (f"learned step cost by drafts {format_step_costs(spec.get('step_ms', ()))}, "
            f"acceptance estimate {spec.get('acceptance_estimate', 0):.2f}")


def run(args: argparse.Namespace) -> int:
    from meshnode.bench import prompt_sets
    from meshnode.bench.serve_bench import _rotated
    from meshnode.models.store import resolve_model
    from meshnode.paths import NodePaths

    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for s in strategies:
        if s not in STRATEGIES:
            print(f"meshnode bench spec: unknown strategy {s!r}", file=sys.stderr)
            return 2
    if args.netns:
        from meshnode.bench.netns import unavailable

        why = unavailable()
        if why:
            print(f"meshnode bench spec: --netns is not available here: {why}", file=sys.stderr)
            return 2
    max_tokens = args.tokens or (96 if args.quick else 160)
    workloads = {w: prompt_sets.select(prompt_sets.load(w), args.split, quick=args.quick, limit=args.prompts)
                 for w in WORKLOADS}
    paths = NodePaths.resolve(getattr(args, "home", None)).ensure()
    ref = resolve_model(args.model, paths)
    if args.draft_layers is not None and args.draft_layers >= ref.n_layers:
        print(f"meshnode bench spec: --draft-layers {args.draft_layers}: {ref.name} has "
              f"{ref.n_layers} layers; a truncated draft keeps fewer", file=sys.stderr)
        return 2
    draft_path = (derived_model(ref, paths, args.draft_quant, "draft", args.draft_layers)
                  if "draft" in strategies else None)
    target = derived_model(ref, paths, args.target_quant, "target") if args.target_quant else ref.path
    place = ("network namespaces on a bridge (own addresses, 1500-byte MTU)" if args.netns
             else "loopback")
    latency = (f"latency: emulated by a delaying UDP relay, {args.delay_ms:g} ms each way "
               f"(no netem in this kernel)")
    print(f"spec benchmark: {target.name}, 2 stages on {place}, {args.threads} thread(s) per stage, "
          f"greedy, max_tokens {max_tokens}, set {args.split}{' (quick)' if args.quick else ''}: "
          f"{len(workloads['code_edit'])} + {len(workloads['mixed_chat'])} prompts, "
          f"load average {os.getloadavg()[0]:.2f}"
          + (f", repetition_penalty {args.repetition_penalty:g}" if args.repetition_penalty else ""), file=sys.stderr)
    print(latency, file=sys.stderr, flush=True)
    extra = {"repetition_penalty": args.repetition_penalty} if args.repetition_penalty else None

    common = ("--gpu-layers", gpu_layers_flag(args.gpu_layers), "--threads", str(args.threads), "--ctx", str(args.ctx),
              # one request at a time, each prefilled in full: speculation alone is measured
              # (`bench prefix` measures prefix reuse, with or without it)
              "--batch", "64", "--parallel", "1", "--prefix-cache", "0",
              *(("--decode-threads", str(args.decode_threads)) if args.decode_threads else ()),
              *(("--draft-max", str(args.draft_max)) if args.draft_max else ()), *busy_poll_flags(args))
    rounds = args.rounds or (2 if args.quick else 3)
    # raw[workload][strategy][prompt index] = one run per round
    raw = {w: {s: [[] for _ in workloads[w]] for s in strategies} for w in WORKLOADS}
    with contextlib.ExitStack() as stack:
        net = None
        if args.netns:
            from meshnode.bench.netns import Netns

            net = stack.enter_context(Netns(2))
        splits = {s: _start_split(stack, s, target, draft_path, common, args, net) for s in strategies}
        for rnd in range(rounds):
            t0 = time.perf_counter()
            for w in WORKLOADS:
                for i, prompt in enumerate(workloads[w]):
                    # every strategy answers this prompt back to back, in an order rotated per
                    # prompt and round, so a slow spell of the machine hits them alike; the key
                    # makes the prompt (or its editor sequence) one client, new every round
                    for strategy in _rotated(strategies, rnd + i):
                        base, model, _, coord = splits[strategy]
                        raw[w][strategy][i].append(_complete(
                            base, model, prompt.chat(), max_tokens, f"r{rnd}-{prompt.client}", coord.inside,
                            extra))
                    print(f"    round {rnd + 1}/{rounds}: {w} {i + 1}/{len(workloads[w])}",
                          file=sys.stderr, flush=True)
            print(f"  round {rnd + 1}/{rounds}: {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
        learned = {s: _learned_costs(splits[s][3]) for s in strategies if s != "baseline"}
        shapes = {s: _call_shapes(splits[s][3]) for s in strategies}
        up = sum(relay.relay.counters.datagrams_up for _, _, relay, _ in splits.values())
        down = sum(relay.relay.counters.datagrams_down for _, _, relay, _ in splits.values())
    print(f"relays forwarded {up} datagrams up, {down} down", file=sys.stderr)
    results = {w: {s: _summary(raw[w][s]) for s in strategies} for w in WORKLOADS}
    kinds = {w: {s: _by_kind(raw[w][s], raw[w].get("baseline"), workloads[w]) for s in strategies}
             for w in WORKLOADS}
    for line in _differences(raw, strategies):
        print(line, file=sys.stderr)

    out: dict[str, dict[str, dict]] = {}
    print(latency + f"; stages on {place}")
    print(f"{'workload':<11} {'strategy':<11} {'wall t/s':>8} {'wall x':>7} {'TTFT ms':>8} {'tok/s':>7} "
          f"{'decode x':>8} {'accept':>7} {'acc/win':>7} {'windows':>8} {'ms/win':>7} {'plain':>6} "
          f"{'ms/plain':>9} {'ahead':>9} {'same text':>10}")
    for w in WORKLOADS:
        base = results[w].get("baseline")
        out[w] = {}
        for s in strategies:
            r = results[w][s]
            speedup = r["tok_s"] / base["tok_s"] if base and base["tok_s"] else float("nan")
            wall_x = r["wall_tok_s"] / base["wall_tok_s"] if base and base["wall_tok_s"] else float("nan")
            same = "-" if base is None else ("yes" if r["texts"] == base["texts"] and r["stable"] else "NO")
            print(f"{w:<11} {s:<11} {r['wall_tok_s']:>8.1f} {wall_x:>6.2f}x {r['ttft_ms']:>8.0f} "
                  f"{r['tok_s']:>7.1f} {speedup:>7.2f}x {r['acceptance']:>7.2f} "
                  f"{r['accepted_per_window']:>7.2f} {r['windows']:>8d} {r['ms_per_window']:>7.1f} "
                  f"{r['plain_steps']:>6d} {r['ms_per_plain_step']:>9.1f} "
                  f"{r['lookahead_used']:>4d}/{r['lookahead']:<4d} {same:>10}")
            out[w][s] = {"tok_s": round(r["tok_s"], 2), "acceptance": round(r["acceptance"], 3),
                         "speedup": round(speedup, 3),
                         "wall_tok_s": round(r["wall_tok_s"], 2), "wall_speedup": round(wall_x, 3),
                         "ttft_ms": round(r["ttft_ms"], 1),
                         "accepted_per_window": round(r["accepted_per_window"], 3),
                         "draft_n": r["draft_n"],
                         "draft_n_accepted": r["draft_n_accepted"], "windows": r["windows"],
                         "ms_per_window": round(r["ms_per_window"], 2),
                         "plain_steps": r["plain_steps"],
                         "ms_per_plain_step": round(r["ms_per_plain_step"], 2),
                         "lookahead": r["lookahead"], "lookahead_used": r["lookahead_used"],
                         "model_windows": r["model_windows"], "model_drafts": r["model_drafts"],
                         "model_accepted": r["model_accepted"],
                         "tokens": r["tokens"], "same_text_as_baseline": same != "NO",
                         "kinds": kinds[w][s]}
    for w in WORKLOADS:
        r = results[w].get("draft")
        if r and r["windows"]:
            mw, nw = r["model_windows"], r["windows"] - r["model_windows"]
            nd, na = r["draft_n"] - r["model_drafts"], r["draft_n_accepted"] - r["model_accepted"]
            print(f"{w:<11} draft: {mw} windows from the draft model ({r['model_drafts'] / mw if mw else 0:.2f} "
                  f"drafts each, acceptance {r['model_accepted'] / r['model_drafts'] if r['model_drafts'] else 0:.2f}), "
                  f"{nw} from n-gram ({nd / nw if nw else 0:.2f} drafts each, acceptance {na / nd if nd else 0:.2f})")
    for s, line in learned.items():
        print(f"{s:<11} {line}")
    for s, lines in shapes.items():
        for line in lines:
            print(f"{s:<11} {line}")
    if "baseline" in strategies and len(strategies) > 1:
        print("by kind: wall-clock speedup against baseline (acceptance)")
        for w in WORKLOADS:
            for k in sorted(kinds[w]["baseline"]):
                print(f"  {w:<11} {k:<11} " + "  ".join(
                    f"{s} {kinds[w][s][k]['wall_speedup']:.2f}x ({kinds[w][s][k]['acceptance']:.2f})"
                    for s in strategies if s != "baseline"))
    if args.json:
        print(json.dumps(out))
    return 0


def _by_kind(runs: list[list[dict]], base_runs: list[list[dict]] | None, prompts) -> dict:
    """Per kind of prompt: wall-clock speedup against the baseline (total seconds of the
    fastest rounds) and acceptance (every round)."""
    out: dict[str, dict] = {}
    for kind in sorted({p.kind for p in prompts}):
        idx = [i for i, p in enumerate(prompts) if p.kind == kind]
        wall = sum(min(r["wall_s"] for r in runs[i]) for i in idx)
        base = sum(min(r["wall_s"] for r in base_runs[i]) for i in idx) if base_runs else 0.0
        n = sum(r["timings"].get("draft_n", 0) for i in idx for r in runs[i])
        acc = sum(r["timings"].get("draft_n_accepted", 0) for i in idx for r in runs[i])
        out[kind] = {"prompts": len(idx), "wall_speedup": round(base / wall, 3) if wall and base else 0.0,
                     "acceptance": round(acc / n, 3) if n else 0.0}
    return out
