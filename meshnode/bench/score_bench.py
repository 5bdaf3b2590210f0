"""Scored prompts, as evaluation harnesses send them: prefill with and without scores,
and multiple-choice batches with the prefix cache off and on.

Two 2-stage splits of the same model, each behind its own delaying UDP relay (the
topology of ``bench spec``: :func:`meshnode.bench.spec_bench._start_split`), both
``--parallel 4`` (a batch of 4 prompts beside a kept session): ``cold`` with
``--prefix-cache 0`` and ``warm`` with the cache on (the default).

1. **Prefill**: each prompt (a file of the ``code_edit`` prompt set with a question
   after it) sent to the cold split as a plain completion (``max_tokens`` 1) and scored
   (``echo``, ``logprobs`` 0, ``max_tokens`` 1), back to back in a rotated order. A scored
   chunk waits for its logits from the final stage, a plain one does not; the ratio of
   the two prompt rates says how much of a split's overlap of consecutive chunks the
   scored prompt keeps (docs/api.md, "Echo").
2. **Multiple choice**: the same prompts, each with 4 one-token answer choices, as one
   batch per question (``echo``, ``logprobs`` 1, ``max_tokens`` 1: lm-eval's
   ``local-completions``), on both splits: the median wall time per question, cold /
   warm, the prompt tokens the warm split reused, and whether every logprob is the same
   (it must be: the exit status is 1 if not).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from meshnode.argtypes import gpu_layers_flag, positive_int
from meshnode.bench.spec_bench import add_split_arguments

HELP = "scored prompts (echo, logprobs): prefill with and without scores, multiple choice with the prefix cache off vs on"

SPLITS = ("cold", "warm")
CHOICES = (" A", " B", " C", " D")
QUESTION = "\n\nWhich letter names the kind of change this code needs?\nAnswer:"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_split_arguments(p)
    p.add_argument("--prompts", type=positive_int, default=4, help="questions (prompt-set files) to send (default 4)")
    p.add_argument("--chars", type=positive_int, default=2400,
                   help="characters of each file the question follows (default 2400, ~600 tokens)")
    p.add_argument("--concurrent", action="store_true",
                   help="send a question's choices as separate requests at once (concurrent clients) "
                        "instead of one batch")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")


def _contexts(n: int, chars: int) -> list[str]:
    from meshnode.bench import prompt_sets

    files = [p.chat()[-1]["content"] for p in prompt_sets.load("code_edit") if not p.sequence]
    files = sorted(files, key=len, reverse=True)[:n]
    return [f[:chars] + QUESTION for f in files]


def _post(coord, base: str, body: dict) -> tuple[dict, float]:
    import httpx

    with coord.inside(), httpx.Client(timeout=600, trust_env=False) as client:   # loopback: no proxy
        t0 = time.perf_counter()
        r = client.post(f"{base}/completions", json=body)
        wall = time.perf_counter() - t0
    r.raise_for_status()
    return r.json(), wall


def run(args: argparse.Namespace) -> int:
    from meshnode.bench.serve_bench import _rotated
    from meshnode.bench.spec_bench import _start_split, split_flags
    from meshnode.models.store import resolve_model
    from meshnode.paths import NodePaths

    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    contexts = _contexts(args.prompts, args.chars)
    paths = NodePaths.resolve(getattr(args, "home", None)).ensure()
    ref = resolve_model(args.model, paths)
    common = (*split_flags(args), "--batch", "64", "--parallel", "4", "--spec-mode", "off")
    flags = {"cold": ("--prefix-cache", "0"), "warm": ()}
    latency = f"latency: a delaying UDP relay, {args.delay_ms:g} ms each way"
    print(f"score benchmark: {ref.name}, 2 stages on loopback, {args.threads} thread(s) per stage, gpu layers {gpu_layers_flag(args.gpu_layers)}, "
          f"{len(contexts)} questions of ~{args.chars} characters, {len(CHOICES)} choices each; {latency}",
          file=sys.stderr, flush=True)
    with contextlib.ExitStack() as stack:
        splits = {s: _start_split(stack, "baseline", ref.path, None, common + flags[s],
                                  argparse.Namespace(threads=args.threads, pin=False, delay_ms=args.delay_ms))
                  for s in SPLITS}
        base, model, _, coord = splits["cold"]
        # 1. prefill, plain and scored, on the cold split
        rates: dict[str, list[float]] = {"plain": [], "scored": []}
        for i, ctx in enumerate(contexts):
            for mode in _rotated(["plain", "scored"], i):
                body = {"model": model, "prompt": ctx, "max_tokens": 1, "temperature": 0}
                if mode == "scored":
                    body.update(echo=True, logprobs=0)
                r, wall = _post(coord, base, body)
                rates[mode].append(r["usage"]["prompt_tokens"] / wall)
        print(f"  prefill: {len(contexts)} prompts, plain and scored", file=sys.stderr, flush=True)
        # 2. multiple choice: one batch per question, on both splits
        mc: dict[str, list[dict]] = {s: [] for s in SPLITS}
        for i, ctx in enumerate(contexts):
            for s in _rotated(list(SPLITS), i):
                base, model, _, coord = splits[s]
                body = {"model": model, "prompt": [ctx + c for c in CHOICES], "max_tokens": 1, "temperature": 0,
                        "echo": True, "logprobs": 1}
                if args.concurrent:   # one request per choice, all at once
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(len(CHOICES)) as pool:
                        rs = list(pool.map(lambda p, b=body, c=coord, u=base: _post(c, u, {**b, "prompt": p})[0],
                                           body["prompt"]))
                    wall = time.perf_counter() - t0
                    choices = [r["choices"][0]["logprobs"] for r in rs]
                    tokens = sum(r["usage"]["prompt_tokens"] for r in rs)
                else:
                    r, wall = _post(coord, base, body)
                    choices, tokens = [c["logprobs"] for c in r["choices"]], r["usage"]["prompt_tokens"]
                mc[s].append({"wall_s": wall, "choices": choices, "prompt_tokens": tokens})
        stats = {s: splits[s][3].get("/status").get("prefix_cache") for s in SPLITS}

    plain, scored = statistics.median(rates["plain"]), statistics.median(rates["scored"])
    same = all(a["choices"] == b["choices"] for a, b in zip(mc["cold"], mc["warm"]))
    wall = {s: statistics.median(q["wall_s"] for q in mc[s]) for s in SPLITS}
    tokens = statistics.median(q["prompt_tokens"] for q in mc["cold"])
    print(latency)
    print(f"prefill (cold split, median over {len(contexts)} prompts): plain {plain:.1f} tok/s, "
          f"scored {scored:.1f} tok/s: scored/plain {scored / plain:.2f}")
    how = "as concurrent requests" if args.concurrent else "one batch"
    print(f"multiple choice ({len(CHOICES)} prompts of ~{tokens / len(CHOICES):.0f} tokens per question, {how}): "
          f"cold {wall['cold']:.2f} s, warm {wall['warm']:.2f} s per question: cold/warm {wall['cold'] / wall['warm']:.2f}x; "
          f"reused {stats['warm']['tokens_reused']} tokens in {stats['warm']['hits']} hits; "
          f"same logprobs: {'yes' if same else 'NO'}")
    out = {"prefill_tok_s": {"plain": round(plain, 2), "scored": round(scored, 2)},
           "scored_over_plain": round(scored / plain, 3), "mc_wall_s": wall,
           "mc_ratio": round(wall["cold"] / wall["warm"], 3), "same_logprobs": same, "prefix_cache": stats}
    if args.json:
        print(json.dumps(out))
    return 0 if same else 1
