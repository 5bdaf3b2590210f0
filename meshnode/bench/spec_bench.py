"""Speculative decoding over a 2-stage split with emulated LAN latency.

Topology (all on this machine, real node processes with their own homes)::

    coordinator A (stage 0) --QUIC--> UdpDelayRelay (+delay each way) --> node B (stage 1)

B runs with ``--no-discovery --quic-port P``; the relay listens on R and forwards to
127.0.0.1:P; A runs with ``--no-discovery --peer 127.0.0.1:R --split 2``, so every
packet between the stages crosses the relay. Kernels without netem are
common (docs/testing.md), so the relay is the latency emulation; the output says so.

Strategies, each on a split of its own (all up for the whole run): ``baseline``
(``--spec-mode off``), ``ngram_auto`` (``--spec ngram --spec-mode auto``) and ``draft``
(``--draft-model D``, where D is the target requantized to Q4_0 with llama.cpp's
quantizer, or with ``--draft-layers N`` its first N layers plus the head; made once and
cached). Workloads: ``code_edit`` (code given in the prompt, asked to be renamed or
refactored: the answer copies most of it) and ``mixed_chat`` (open questions, stories,
explanations). Every prompt is answered by every strategy back to back, in an order
rotated per prompt and round, so the machine's drift hits the strategies alike (on this
shared VM a plain step's speed moves by 5-10% over minutes). Decode tokens/s is the
response's ``timings.predicted_per_second`` averaged over prompts; acceptance is
``sum(draft_n_accepted) / sum(draft_n)``; speedup is against that workload's baseline
in the same invocation. Where the time went, from the responses' ``timings`` summed
over every round: verify windows and their mean time, plain (one-token) steps and
theirs, lookahead windows used / sent. Greedy decoding throughout, so every strategy
must produce the same text (checked and reported).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from meshnode.argtypes import GPU_LAYERS_HELP, gpu_layers, positive_int

HELP = "speculative decoding benchmark: baseline vs n-gram auto vs draft model on a 2-stage split"

STRATEGIES = ("baseline", "ngram_auto", "draft")
WORKLOADS = ("code_edit", "mixed_chat")

_CODE = [
    ("Rename the function `calc` to `compute_total` and the variable `lst` to `items`. "
     "Return the whole code, nothing else.",
     '''def calc(lst, tax):
    total = 0
    for x in lst:
        if x.price > 0:
            total += x.price * x.quantity
        else:
            print("skipping", x.name)
    total = total * (1 + tax)
    return round(total, 2)


def report(lst, tax):
    value = calc(lst, tax)
    print("items:", len(lst))
    print("total:", value)
    return value


def cheapest(lst):
    best = None
    for x in lst:
        if best is None or x.price < best.price:
            best = x
    return best
'''),
    ("Refactor this class: rename `Stack` to `LifoQueue` and `data` to `items`. "
     "Give the full code.",
     '''class Stack:
    def __init__(self):
        self.data = []

    def push(self, value):
        self.data.append(value)

    def pop(self):
        if not self.data:
            raise IndexError("pop from empty stack")
        return self.data.pop()

    def peek(self):
        if not self.data:
            return None
        return self.data[-1]

    def size(self):
        return len(self.data)

    def is_empty(self):
        return len(self.data) == 0
'''),
    ("Rename the variable `n` to `count` everywhere in this code. Return the whole code.",
     '''def repeat(word, n):
    result = []
    for i in range(n):
        result.append(word)
    return result


def join_words(words, sep):
    text = ""
    for i, w in enumerate(words):
        if i > 0:
            text += sep
        text += w
    return text


def shout(word, n):
    words = repeat(word.upper(), n)
    return join_words(words, " ")
'''),
    ("Rewrite this JavaScript to use `const` instead of `var` and rename `arr` to `values`. "
     "Output the whole code.",
     '''function sum(arr) {
    var total = 0;
    for (var i = 0; i < arr.length; i++) {
        total += arr[i];
    }
    return total;
}

function average(arr) {
    var n = arr.length;
    if (n === 0) {
        return 0;
    }
    return sum(arr) / n;
}

function maximum(arr) {
    var best = arr[0];
    for (var i = 1; i < arr.length; i++) {
        if (arr[i] > best) {
            best = arr[i];
        }
    }
    return best;
}
'''),
]

CODE_EDIT = [f"{ask}\n\n```\n{code}```" for ask, code in _CODE]

MIXED_CHAT = [
    "Write a short story about a fox who learns to swim.",
    "Why is the sky blue? Explain it to a ten-year-old.",
    "What are three good habits for staying healthy while working from home?",
    "Explain what a hash table is and when you would use one.",
    "Describe a perfect autumn day in a small mountain village.",
    "What should I consider when choosing my first programming language?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF or store name (default: the default model)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="llama.cpp threads per stage (default 1)")
    p.add_argument("--decode-threads", type=positive_int, default=None, metavar="N",
                   help="llama.cpp threads for one-token steps on every node (default: --threads; "
                        "1 keeps speculation token-identical when --threads > 1)")
    p.add_argument("--gpu-layers", type=gpu_layers, default=-1, metavar="N|all|auto", help=GPU_LAYERS_HELP)
    p.add_argument("--draft-max", type=positive_int, default=None, metavar="N",
                   help="largest verify window on every node (default: the node's, 32)")
    p.add_argument("--pin", action="store_true",
                   help="give each node CPUs of its own (--cpus), when the machine has enough "
                        "(default: the OS places them)")
    p.add_argument("--delay-ms", type=float, default=5.0,
                   help="latency added by the relay, each way (default 5 ms)")
    p.add_argument("--tokens", type=positive_int, default=None,
                   help="max tokens per completion (default 160, --quick 96)")
    p.add_argument("--prompts", type=positive_int, default=None,
                   help="prompts per workload (default all, --quick 2)")
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
    p.add_argument("--quick", action="store_true", help="fewer prompts, tokens and rounds (a few minutes)")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")


def _quant_type(name: str) -> str:
    """argparse type: a llama.cpp quantization name (checked here, before any work)."""
    from meshnode.engine.quantize import QUANT_TYPES

    if name.upper() not in QUANT_TYPES:
        raise argparse.ArgumentTypeError(f"unknown type {name!r}; choose one of {', '.join(QUANT_TYPES)}")
    return name.upper()


# ---- the relay, in a thread of its own (the benchmark itself blocks on HTTP) ----------


class _RelayThread:
    def __init__(self, target_port: int, delay_s: float) -> None:
        import asyncio
        import threading

        from meshnode.bench.relay import UdpDelayRelay

        self._loop = asyncio.new_event_loop()
        self.relay = UdpDelayRelay(("127.0.0.1", 0), ("127.0.0.1", target_port), delay_s)
        self._thread = threading.Thread(target=self._loop.run_forever, name="relay", daemon=True)
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


def _complete(base: str, model: str, prompt: str, max_tokens: int) -> dict:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{base}/chat/completions", json=body, timeout=600, trust_env=False)  # loopback: no proxy
    r.raise_for_status()
    data = r.json()
    return {"text": data["choices"][0]["message"]["content"],
            "tokens": data["usage"]["completion_tokens"], "timings": data.get("timings") or {}}


def _summary(runs_by_prompt: list[list[dict]]) -> dict:
    """Per prompt, the fastest of its rounds; then the mean over prompts.

    Other processes on a shared machine only ever slow a run down, so the fastest round
    is the least disturbed one. Draft counters are summed over every round.
    """
    best = [max(rs, key=lambda r: r["timings"].get("predicted_per_second", 0.0)) for rs in runs_by_prompt]
    every = [r for rs in runs_by_prompt for r in rs]
    def total(key: str) -> float:
        return sum(r["timings"].get(key, 0) for r in every)

    draft_n, accepted, windows, plain, ahead, ahead_used = (total(k) for k in (
        "draft_n", "draft_n_accepted", "draft_windows", "plain_steps", "draft_lookahead",
        "draft_lookahead_used"))
    verify_ms = total("draft_verify_ms")
    # decode time not spent verifying is plain steps (plus the per-token bookkeeping)
    plain_ms = total("predicted_ms") - verify_ms
    return {
        "tok_s": statistics.mean(r["timings"].get("predicted_per_second", 0.0) for r in best),
        "acceptance": accepted / draft_n if draft_n else 0.0,
        "draft_n": int(draft_n),
        "draft_n_accepted": int(accepted),
        "windows": int(windows),
        "ms_per_window": verify_ms / windows if windows else 0.0,
        "plain_steps": int(plain),
        "ms_per_plain_step": plain_ms / plain if plain else 0.0,
        "lookahead": int(ahead),
        "lookahead_used": int(ahead_used),
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


def _derived(ref, paths, quant: str, role: str, n_layers: int | None = None):
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


def _start_split(stack: contextlib.ExitStack, strategy: str, target, draft_path, common: tuple,
                 args: argparse.Namespace) -> tuple[str, str, _RelayThread]:
    """One 2-stage split serving ``strategy``: stage 1, the relay in front of it, and a
    warmed-up coordinator; all torn down by ``stack``. Returns (base URL, model, relay)."""
    from meshnode.bench.cluster import LocalCluster, cpu_flags, free_udp_port

    print(f"  starting the {strategy} split ...", file=sys.stderr, flush=True)
    cluster = stack.enter_context(LocalCluster(target, 2))
    quic_port = free_udp_port()
    cluster.start(1, "--no-model", "--no-discovery", "--quic-port", str(quic_port), *common,
                  *cpu_flags(1, 2, args.threads, pin=args.pin))
    relay = _RelayThread(quic_port, args.delay_ms / 1000.0)
    stack.callback(relay.stop)
    coord = cluster.start(0, "--no-discovery", "--peer", f"127.0.0.1:{relay.port}", "--split", "2",
                          "--model", str(target), *common, *_strategy_flags(strategy, draft_path),
                          *cpu_flags(0, 2, args.threads, pin=args.pin)).wait_model()
    if strategy == "draft" and "serving without it" in coord.log_tail(100_000):
        print("  warning: the draft model was disabled (see the node log)", file=sys.stderr)
    model = coord.get("/v1/models")["data"][0]["id"]
    _complete(coord.base_url, model, "Hello", 4)  # warm-up
    return coord.base_url, model, relay


def run(args: argparse.Namespace) -> int:
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
    max_tokens = args.tokens or (96 if args.quick else 160)
    n_prompts = args.prompts or (2 if args.quick else None)
    workloads = {"code_edit": CODE_EDIT[:n_prompts], "mixed_chat": MIXED_CHAT[:n_prompts]}
    paths = NodePaths.resolve(getattr(args, "home", None)).ensure()
    ref = resolve_model(args.model, paths)
    if args.draft_layers is not None and args.draft_layers >= ref.n_layers:
        print(f"meshnode bench spec: --draft-layers {args.draft_layers}: {ref.name} has "
              f"{ref.n_layers} layers; a truncated draft keeps fewer", file=sys.stderr)
        return 2
    draft_path = (_derived(ref, paths, args.draft_quant, "draft", args.draft_layers)
                  if "draft" in strategies else None)
    target = _derived(ref, paths, args.target_quant, "target") if args.target_quant else ref.path
    latency = (f"latency: emulated by a delaying UDP relay, {args.delay_ms:g} ms each way "
               f"(no netem in this kernel)")
    print(f"spec benchmark: {target.name}, 2 stages on loopback, {args.threads} thread(s) per stage, "
          f"greedy, max_tokens {max_tokens}, {len(workloads['code_edit'])} + "
          f"{len(workloads['mixed_chat'])} prompts, load average {os.getloadavg()[0]:.2f}",
          file=sys.stderr)
    print(latency, file=sys.stderr, flush=True)

    common = ("--gpu-layers", str(args.gpu_layers), "--threads", str(args.threads), "--ctx", "1024", "--batch", "64", "--parallel", "1",
              *(("--decode-threads", str(args.decode_threads)) if args.decode_threads else ()),
              *(("--draft-max", str(args.draft_max)) if args.draft_max else ()))
    rounds = args.rounds or (2 if args.quick else 3)
    # raw[workload][strategy][prompt index] = one run per round
    raw = {w: {s: [[] for _ in workloads[w]] for s in strategies} for w in WORKLOADS}
    with contextlib.ExitStack() as stack:
        splits = {s: _start_split(stack, s, target, draft_path, common, args) for s in strategies}
        for rnd in range(rounds):
            t0 = time.perf_counter()
            for w in WORKLOADS:
                for i, prompt in enumerate(workloads[w]):
                    # every strategy answers this prompt back to back, in an order rotated per
                    # prompt and round, so a slow spell of the machine hits them alike
                    for strategy in _rotated(strategies, rnd + i):
                        base, model, _ = splits[strategy]
                        raw[w][strategy][i].append(_complete(base, model, prompt, max_tokens))
            print(f"  round {rnd + 1}/{rounds}: {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
        up = sum(relay.relay.counters.datagrams_up for _, _, relay in splits.values())
        down = sum(relay.relay.counters.datagrams_down for _, _, relay in splits.values())
    print(f"relays forwarded {up} datagrams up, {down} down", file=sys.stderr)
    results = {w: {s: _summary(raw[w][s]) for s in strategies} for w in WORKLOADS}
    for line in _differences(raw, strategies):
        print(line, file=sys.stderr)

    out: dict[str, dict[str, dict]] = {}
    print(latency)
    print(f"{'workload':<11} {'strategy':<11} {'tok/s':>7} {'accept':>7} {'drafts':>7} "
          f"{'windows':>8} {'ms/win':>7} {'plain':>6} {'ms/plain':>9} {'ahead':>9} {'speedup':>8} "
          f"{'same text':>10}")
    for w in WORKLOADS:
        base = results[w].get("baseline")
        out[w] = {}
        for s in strategies:
            r = results[w][s]
            speedup = r["tok_s"] / base["tok_s"] if base and base["tok_s"] else float("nan")
            same = "-" if base is None else ("yes" if r["texts"] == base["texts"] and r["stable"] else "NO")
            print(f"{w:<11} {s:<11} {r['tok_s']:>7.1f} {r['acceptance']:>7.2f} {r['draft_n']:>7d} "
                  f"{r['windows']:>8d} {r['ms_per_window']:>7.1f} {r['plain_steps']:>6d} "
                  f"{r['ms_per_plain_step']:>9.1f} {r['lookahead_used']:>4d}/{r['lookahead']:<4d} "
                  f"{speedup:>7.2f}x {same:>10}")
            out[w][s] = {"tok_s": round(r["tok_s"], 2), "acceptance": round(r["acceptance"], 3),
                         "speedup": round(speedup, 3), "draft_n": r["draft_n"],
                         "draft_n_accepted": r["draft_n_accepted"], "windows": r["windows"],
                         "ms_per_window": round(r["ms_per_window"], 2),
                         "plain_steps": r["plain_steps"],
                         "ms_per_plain_step": round(r["ms_per_plain_step"], 2),
                         "lookahead": r["lookahead"], "lookahead_used": r["lookahead_used"],
                         "tokens": r["tokens"], "same_text_as_baseline": same != "NO"}
    if args.json:
        print(json.dumps(out))
    return 0
