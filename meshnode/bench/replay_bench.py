"""`meshnode bench replay`: the n-gram proposer and window policy, replayed offline.

A live `meshnode bench spec` run takes minutes and its ratios move by 0.1 between runs on
a shared machine, which hides the effect of a proposer change. This benchmark takes the
noise out: it decodes the spec benchmark's prompts greedily once, in process (whole
model, no network), measures what a step of ``k`` drafts costs on this machine's engine,
and then replays every answer through :class:`~meshnode.spec.ngram.NGramProposer` and
:class:`~meshnode.spec.window.AdaptiveWindow` for each ``--max-n`` asked for. A replay is
deterministic: the answer is known, so a window's accepted prefix is counted, not
sampled.

Per workload and ``max_n`` it prints the pipeline steps needed for the answers (plain
steps and verify windows), the drafts proposed and accepted, and the *predicted* speedup
of drafting over plain decoding: ``sum over steps of cost(k)`` against ``tokens x
cost(0)``, where ``cost(k) = --hop-ms + engine time of k + 1 rows``. ``--hop-ms`` stands
for what a split adds to every step (default 13: the spec benchmark's emulated 5 ms
each way plus ~3 ms of messaging between two stages on loopback).

What it leaves out, on purpose: the auto policy (drafting is on for the whole answer,
as in its ENABLED state) and lookahead windows (their overlap depends on timing), so
the predicted numbers are below what the live benchmark reaches on code editing and
are a comparison between proposer settings, not a forecast. `--json`: the last line is
``{workload: {max_n: {steps, plain_steps, drafts, accepted, acceptance, tokens,
predicted_speedup}}}`` plus ``step_ms`` (the measured engine cost by drafts).
"""

from __future__ import annotations

import argparse

from meshnode.argtypes import non_negative_float, positive_int

MEASURED_DRAFTS = (0, 1, 2, 3, 4, 6, 8, 12, 16)   # the cost model interpolates between them
HELP = "replay the spec benchmark's answers through the n-gram proposer, offline (deterministic)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name, path or sha256 (default: the default model)")
    p.add_argument("--tokens", type=positive_int, default=160, help="max tokens per answer (default 160)")
    p.add_argument("--prompts", type=positive_int, default=None,
                   help="prompts per workload (default: all of `bench spec`'s)")
    p.add_argument("--max-n", type=_max_ns, default=[4, 12], metavar="N,N,...",
                   help="proposer max_n values to compare (default 4,12)")
    p.add_argument("--hop-ms", type=non_negative_float, default=13.0,
                   help="time a split adds to every step, in ms (default 13)")
    p.add_argument("--threads", type=positive_int, default=1, help="llama.cpp threads (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def _max_ns(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"want positive integers separated by commas, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    from meshnode.bench.spec_bench import CODE_EDIT, MIXED_CHAT
    from meshnode.engine import EngineConfig, StageEngine
    from meshnode.engine.tokenizer import Tokenizer
    from meshnode.models.store import resolve_model
    from meshnode.paths import NodePaths
    from meshnode.spec.ngram import MIN_NGRAM_MATCH
    from meshnode.spec.cost_model import CostModel

    paths = NodePaths.resolve(args.home).ensure()
    ref = resolve_model(args.model, paths)
    workloads = {"code_edit": CODE_EDIT[: args.prompts], "mixed_chat": MIXED_CHAT[: args.prompts]}

    tok = Tokenizer(ref.path)
    prompts = {w: [tok.apply_chat_template([{"role": "user", "content": p}])[0] for p in ps]
               for w, ps in workloads.items()}
    n_ctx = max(len(t) for ps in prompts.values() for t in ps) + args.tokens + MEASURED_DRAFTS[-1] + 8
    engine = StageEngine(EngineConfig(ref.path, n_ctx=n_ctx, n_batch=64, n_seq_max=1, n_threads=args.threads))
    answers: dict[str, list[list[int]]] = {}
    try:
        for w, ps in prompts.items():
            print(f"  {w}: decoding {len(ps)} greedy answer(s)", file=sys.stderr, flush=True)
            answers[w] = [_greedy(engine, p, args.tokens, tok.eog_ids) for p in ps]
        print("  measuring step costs", file=sys.stderr, flush=True)
        step_ms = _step_costs(engine, prompts["code_edit"][0], MEASURED_DRAFTS)
    finally:
        engine.close()
        tok.close()

    cost = CostModel(step_s=step_ms[0] / 1000)
    for k, ms in step_ms.items():
        cost.observe(k, (args.hop_ms + ms) / 1000)
    print(f"replay: {ref.name}, {args.threads} thread(s), hop {args.hop_ms:g} ms, "
          f"min match {MIN_NGRAM_MATCH}; step ms by drafts "
          + " ".join(f"{k}:{1000 * cost.seconds(k):.1f}" for k in (0, 1, 2, 4, 8, 16)))
    print(f"{'workload':11s} {'max_n':>5s} {'steps':>6s} {'plain':>6s} {'drafts':>7s} "
          f"{'accepted':>8s} {'accept':>7s} {'predicted':>10s}")
    result: dict = {"step_ms": {str(k): round(v, 3) for k, v in step_ms.items()}}
    for w in prompts:
        result[w] = {}
        for max_n in args.max_n:
            r = replay(prompts[w], answers[w], max_n, cost, MIN_NGRAM_MATCH)
            result[w][str(max_n)] = r
            print(f"{w:11s} {max_n:5d} {r['steps']:6d} {r['plain_steps']:6d} {r['drafts']:7d} "
                  f"{r['accepted']:8d} {r['acceptance']:7.2f} {r['predicted_speedup']:9.3f}x")
    if args.json:
        print(json.dumps(result))
    return 0


def _greedy(engine, prompt: list[int], max_tokens: int, eog: set[int]) -> list[int]:
    """The whole model's greedy answer (prefill in n_batch chunks, then one row per step)."""
    import numpy as np

    from meshnode.engine import Segment
    from meshnode.spec.acceptance import greedy_token

    logits = engine.run_session(0, 0, np.asarray(prompt, dtype=np.int32), n_logits=1)
    pos = len(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        t = greedy_token(logits[-1])
        if t in eog:
            break
        out.append(t)
        logits = engine.forward([Segment(0, pos, tokens=np.asarray([t], dtype=np.int32), n_logits=1)])[0]
        pos += 1
    engine.drop(0)
    return out


def _step_costs(engine, prompt: list[int], drafts: tuple[int, ...]) -> dict[int, float]:
    """Median ms of a step of k drafts (k + 1 rows, logits for each) for each k in
    ``drafts``, measured after a real prompt and rolled back after each step."""
    import time

    import numpy as np

    from meshnode.engine import Segment

    ids = np.asarray(prompt, dtype=np.int32)
    engine.run_session(0, 0, ids, n_logits=0)
    rows = np.resize(ids, max(drafts) + 1).astype(np.int32)
    times: dict[int, list[float]] = {k: [] for k in drafts}
    for _ in range(5):   # sizes interleaved: a slow moment of the machine hits them all
        for k in drafts:
            t0 = time.perf_counter()
            engine.forward([Segment(0, len(ids), tokens=rows[:k + 1], n_logits=k + 1)], rewind=True)
            times[k].append(time.perf_counter() - t0)
    engine.drop(0)
    return {k: 1000 * float(np.median(t)) for k, t in times.items()}


def replay(prompts: list[list[int]], answers: list[list[int]], max_n: int, cost, min_match: int) -> dict:
    """Replay known greedy ``answers`` through the n-gram proposer and the serving loop's
    default window (one window and ``cost`` model for all prompts, as in one server):
    what drafting would do, and what it would cost by ``cost`` (a CostModel)."""
    from meshnode.spec.ngram import NGramProposer
    from meshnode.spec.window import WindowPolicy, make_window

    window = make_window(WindowPolicy(), cost)
    steps = plain = drafts = accepted = tokens = 0
    spent = 0.0
    for prompt, answer in zip(prompts, answers):
        ngram = NGramProposer(prompt, max_n=max_n)
        i = 0
        while i < len(answer):
            proposal = ngram.propose(window.next_window(), min_match=min_match)
            n = 0
            while n < len(proposal) and i + n < len(answer) and proposal[n] == answer[i + n]:
                n += 1
            if proposal:
                window.update(len(proposal), n)
            new = answer[i:i + n + 1]
            ngram.observe(new)
            i += len(new)
            steps += 1
            plain += not proposal
            drafts += len(proposal)
            accepted += n
            spent += cost.seconds(len(proposal))
        tokens += len(answer)
    return {"steps": steps, "plain_steps": plain, "drafts": drafts, "accepted": accepted,
            "acceptance": round(accepted / drafts, 3) if drafts else 0.0, "tokens": tokens,
            "predicted_speedup": round(tokens * cost.seconds(0) / spent, 3) if spent else 1.0}
