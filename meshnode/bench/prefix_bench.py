"""Prefix reuse: time to first token on editor-like sequences, cold against warm.

Two 2-stage splits of the same model, each behind its own delaying UDP relay (the
topology of ``bench spec``: :func:`meshnode.bench.spec_bench._start_split`), both
``--parallel 2``: ``cold`` with ``--prefix-cache 0`` (every prompt prefilled in full)
and ``warm`` with the cache on (the default). The prompts are the editor sequences of
the ``code_edit`` prompt set (:mod:`meshnode.bench.prompt_sets`): the same file sent
again with small changes and the same request, step by step, as one client. Every step
goes to both splits back to back, in an order rotated per step, so the shared machine's
drift hits them alike.

Printed: per step position (the first step of a sequence is cold on both), the median
time to first token of each split and the ratio cold / warm, the prompt tokens reused
(``timings.cache_n``) and prefilled; then the wall-clock tokens/s over every later step
(prefill included) and its ratio. Greedy decoding: both splits must produce the same
text (checked and reported).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

from meshnode.argtypes import gpu_layers_flag, positive_int
from meshnode.bench.spec_bench import add_split_arguments

HELP = "prefix reuse: time to first token on editor-like sequences, cache off vs on, on a 2-stage split"

SPLITS = ("cold", "warm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_split_arguments(p)
    p.add_argument("--tokens", type=positive_int, default=32, help="max tokens per completion (default 32)")
    p.add_argument("--rounds", type=positive_int, default=2, help="passes over the sequences (default 2)")
    p.add_argument("--set", dest="split", choices=("tune", "heldout", "all"), default="all",
                   help="which half of the prompt set's editor sequences (default all)")
    p.add_argument("--spec-mode", choices=("off", "auto", "on"), default="off",
                   help="n-gram speculation on both splits (default off: prefill alone)")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")


def _sequences(split: str) -> dict[str, list]:
    from meshnode.bench import prompt_sets

    seqs: dict[str, list] = {}
    for p in prompt_sets.select(prompt_sets.load("code_edit"), split):
        if p.sequence:
            seqs.setdefault(p.sequence, []).append(p)
    return seqs


def run(args: argparse.Namespace) -> int:
    from meshnode.bench.serve_bench import _rotated
    from meshnode.bench.spec_bench import _complete, _start_split, split_flags
    from meshnode.models.store import resolve_model
    from meshnode.paths import NodePaths

    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    seqs = _sequences(args.split)
    paths = NodePaths.resolve(getattr(args, "home", None)).ensure()
    ref = resolve_model(args.model, paths)
    spec = ("--spec-mode", "off") if args.spec_mode == "off" else ("--spec", "ngram", "--spec-mode", args.spec_mode)
    common = (*split_flags(args), "--batch", "64", "--parallel", "2", *spec)
    flags = {"cold": ("--prefix-cache", "0"), "warm": ()}
    latency = f"latency: a delaying UDP relay, {args.delay_ms:g} ms each way"
    print(f"prefix benchmark: {ref.name}, 2 stages on loopback, {args.threads} thread(s) per stage, gpu layers {gpu_layers_flag(args.gpu_layers)}, greedy, "
          f"max_tokens {args.tokens}, {len(seqs)} editor sequences ({args.split}), spec {args.spec_mode}; "
          f"{latency}", file=sys.stderr, flush=True)
    # runs[split][step index] = list of completions (every sequence, every round)
    runs: dict[str, dict[int, list[dict]]] = {s: {} for s in SPLITS}
    n = 0
    with contextlib.ExitStack() as stack:
        splits = {s: _start_split(stack, "baseline" if args.spec_mode == "off" else "ngram_auto", ref.path,
                                  None, common + flags[s], argparse.Namespace(threads=args.threads, pin=False,
                                                                              delay_ms=args.delay_ms))
                  for s in SPLITS}
        for rnd in range(args.rounds):
            t0 = time.perf_counter()
            for name, steps in seqs.items():
                for k, p in enumerate(steps):
                    for s in _rotated(list(SPLITS), n):
                        base, model, _, coord = splits[s]
                        runs[s].setdefault(k, []).append(
                            _complete(base, model, p.chat(), args.tokens, f"r{rnd}-{name}", coord.inside))
                    n += 1
            print(f"  round {rnd + 1}/{args.rounds}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        stats = {s: splits[s][3].get("/status").get("prefix_cache") for s in SPLITS}

    same = all(a["text"] == b["text"] for k in runs["cold"] for a, b in zip(runs["cold"][k], runs["warm"][k]))
    out: dict = {"steps": {}, "same_text": same, "prefix_cache": stats}
    print(latency + "; TTFT: median ms per step of a sequence (step 1 is cold on both)")
    print(f"{'step':>4} {'n':>3} {'cold TTFT':>10} {'warm TTFT':>10} {'cold/warm':>9} {'reused':>7} {'prefilled':>9}")
    for k in sorted(runs["cold"]):
        cold, warm = runs["cold"][k], runs["warm"][k]
        tc = statistics.median(r["ttft_s"] for r in cold) * 1e3
        tw = statistics.median(r["ttft_s"] for r in warm) * 1e3
        reused = statistics.mean(r["timings"].get("cache_n", 0) for r in warm)
        pre = statistics.mean(r["timings"].get("prompt_n", 0) for r in warm)
        print(f"{k + 1:>4} {len(cold):>3} {tc:>10.0f} {tw:>10.0f} {tc / tw:>8.2f}x {reused:>7.0f} {pre:>9.0f}")
        out["steps"][k + 1] = {"cold_ttft_ms": round(tc, 1), "warm_ttft_ms": round(tw, 1),
                               "ratio": round(tc / tw, 3), "reused": round(reused, 1), "prefilled": round(pre, 1)}
    later = {s: [r for k, rs in runs[s].items() if k > 0 for r in rs] for s in SPLITS}
    ttft = {s: statistics.median(r["ttft_s"] for r in later[s]) * 1e3 for s in SPLITS}
    wall = {s: sum(r["tokens"] for r in later[s]) / sum(r["wall_s"] for r in later[s]) for s in SPLITS}
    print(f"steps 2+: TTFT cold {ttft['cold']:.0f} ms, warm {ttft['warm']:.0f} ms: {ttft['cold'] / ttft['warm']:.2f}x; "
          f"wall-clock tok/s cold {wall['cold']:.1f}, warm {wall['warm']:.1f}: {wall['warm'] / wall['cold']:.2f}x; "
          f"same text: {'yes' if same else 'NO'}")
    print(f"warm split's cache: {stats['warm']}")
    out.update(ttft_ms=ttft, wall_tok_s=wall, ttft_ratio=round(ttft["cold"] / ttft["warm"], 3),
               wall_ratio=round(wall["warm"] / wall["cold"], 3))
    if args.json:
        print(json.dumps(out))
    return 0 if same else 1
