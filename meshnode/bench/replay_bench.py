"""`meshnode bench replay`: proposers and the window policy, replayed offline.

A live `meshnode bench spec` run takes minutes and its ratios move by 0.1 between runs on
a shared machine, which hides the effect of a proposer change. This benchmark takes the
noise out: it decodes the prompt sets' prompts (:mod:`meshnode.bench.prompt_sets`,
``--set``) greedily once, in process (whole model, no network; answers cached by model,
prompt and ``--tokens``), measures what a step of ``k`` drafts costs on this machine's
engine, and then replays every answer through each proposer asked for and
:class:`~meshnode.spec.window.AdaptiveWindow`. A replay is deterministic: the answer is
known, so a window's accepted prefix is counted, not sampled.

Proposers (``--proposers``): ``ngram`` (:class:`~meshnode.spec.ngram.NGramProposer`, the
request's own prompt and answer) and ``suffix``
(:class:`~meshnode.spec.suffix.SuffixProposer`: the same plus the same client's recent
requests, replayed in order with one client per prompt and one per editor sequence, as
`bench spec` sends them), each for every ``--max-n``; ``suffix`` also for every
``--history-min``. With a draft model (the target requantized to Q4_0, as `bench spec`'s
``draft`` strategy; :class:`~meshnode.spec.draft.DraftModelProposer`): ``draft`` (the
draft model alone), ``hybrid`` (the suffix proposer first, the draft model where it has
nothing, one window for both: how a node with ``--draft-model`` drafts) and
``hybrid-split`` (the same with a window and a learned cost model of its own for each). A draft window costs its step plus ``--draft-ms`` for
each llama.cpp call the draft made for it (catching up, then one per further draft;
default: a one-row step of the draft measured here). Proposers are judged by **accepted
tokens per verify round** (``accepted / windows``) and acceptance; per kind of prompt too.

Per workload and proposer it prints the pipeline steps needed for the answers (plain
steps and verify windows), the drafts proposed and accepted, and the *predicted* speedup
of drafting over plain decoding: ``sum over steps of cost(k)`` against ``tokens x
cost(0)``, where ``cost(k) = --hop-ms + engine time of k + 1 rows``. ``--hop-ms`` stands
for what a split adds to every step (default 13: the spec benchmark's emulated 5 ms
each way plus ~3 ms of messaging between two stages on loopback).

What it leaves out, on purpose: the auto policy (drafting is on for the whole answer,
as in its ENABLED state) and lookahead windows (their overlap depends on timing), so
the predicted numbers are a comparison between proposers, not a forecast. `--json`:
the last line is ``{workload: {proposer: {steps, plain_steps, windows, drafts, accepted,
acceptance, accepted_per_window, tokens, predicted_speedup, kinds: {kind: {...}}}}}``
plus ``step_ms`` (the measured engine cost by drafts).
"""

from __future__ import annotations

import argparse

from meshnode.argtypes import non_negative_float, positive_int

MEASURED_DRAFTS = (0, 1, 2, 3, 4, 6, 8, 12, 16)   # the cost model interpolates between them
HELP = "replay the prompt sets' answers through the proposers, offline (deterministic)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name, path or sha256 (default: the default model)")
    p.add_argument("--tokens", type=positive_int, default=160, help="max tokens per answer (default 160)")
    p.add_argument("--prompts", type=positive_int, default=None,
                   help="prompts per workload (an editor sequence counts as one; default all)")
    p.add_argument("--set", dest="split", choices=("tune", "heldout", "all"), default="all",
                   help="which half of the prompt sets (default all)")
    p.add_argument("--quick", action="store_true", help="only the prompt sets' quick subset")
    p.add_argument("--proposers", type=_proposers, default=["ngram", "suffix"], metavar="P,P",
                   help="proposers to compare: ngram, suffix, draft, hybrid, hybrid-split "
                        "(default ngram,suffix; the last three use a draft model, the target "
                        "requantized to Q4_0)")
    p.add_argument("--draft-ms", type=non_negative_float, default=None, metavar="MS",
                   help="what one llama.cpp call of the draft model costs (default: measured "
                        "here; e.g. a GPU's, to predict for it)")
    p.add_argument("--max-n", type=_max_ns, default=[12], metavar="N,N,...",
                   help="proposer max_n values to compare (default 12)")
    p.add_argument("--history-min", type=_max_ns, default=None, metavar="N,N,...",
                   help="suffix proposer: shortest match drafted from recent requests "
                        "(default: the built-in one)")
    p.add_argument("--min-match", type=_min_matches, default=None, metavar="N|auto,...",
                   help="shortest suffix match an n-gram draft continues, values to compare; "
                        "auto: as a node picks it from the learned step costs (default auto)")
    p.add_argument("--cursor", type=_switches, default=[True], metavar="on|off,...",
                   help="the n-gram proposer's copy cursor, values to compare (default on)")
    p.add_argument("--max-window", type=positive_int, default=None, metavar="N",
                   help="most drafts per window (default: the window policy's; 3 is a GPU "
                        "route's cap at the default pad)")
    p.add_argument("--step-ms", type=_step_ms, default=None, metavar="K:MS,...",
                   help="what a whole step of K drafts costs, hops included, instead of this "
                        "machine's engine plus --hop-ms (e.g. the ms/plain and ms/win of a "
                        "`bench spec` run on other hardware: 0:15,3:17)")
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


def _min_matches(text: str) -> list[int | None]:
    """``--min-match``: positive integers or ``auto`` (None), comma separated."""
    out: list[int | None] = []
    for item in (x.strip() for x in text.split(",")):
        if item == "auto":
            out.append(None)
        elif item:
            out.append(int(item) if item.isdigit() and int(item) >= 1 else 0)
    if not out or 0 in out:
        raise argparse.ArgumentTypeError(f"want positive integers or auto, separated by commas, got {text!r}")
    return out


def _switches(text: str) -> list[bool]:
    """``--cursor``: ``on`` and/or ``off``, comma separated."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items or any(x not in ("on", "off") for x in items):
        raise argparse.ArgumentTypeError(f"want on or off, separated by commas, got {text!r}")
    return [x == "on" for x in items]


def _step_ms(text: str) -> dict[int, float]:
    out: dict[int, float] = {}
    try:
        for item in text.split(","):
            k, _, ms = item.partition(":")
            out[int(k)] = float(ms)
    except ValueError:
        out = {}
    if 0 not in out or any(k < 0 or not 0 < ms < 1e6 for k, ms in out.items()):
        raise argparse.ArgumentTypeError(
            f"want K:MS pairs separated by commas, one of them for K=0 (a plain step), got {text!r}")
    return out


PROPOSERS = ("ngram", "suffix", "draft", "hybrid", "hybrid-split")
DRAFTING = ("draft", "hybrid", "hybrid-split")     # the proposers that need a draft model


def _proposers(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or any(n not in PROPOSERS for n in names):
        raise argparse.ArgumentTypeError(
            f"want some of {', '.join(PROPOSERS)} separated by commas, got {text!r}")
    return names


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    from meshnode.bench import prompt_sets
    from meshnode.engine import EngineConfig, StageEngine
    from meshnode.engine.tokenizer import Tokenizer
    from meshnode.models.store import resolve_model
    from meshnode.paths import NodePaths
    from meshnode.spec.cost_model import CostModel
    from meshnode.spec.suffix import HISTORY_MIN_MATCH

    paths = NodePaths.resolve(args.home).ensure()
    ref = resolve_model(args.model, paths)
    chosen = {w: prompt_sets.select(prompt_sets.load(w), args.split, quick=args.quick, limit=args.prompts)
              for w in prompt_sets.WORKLOADS}

    tok = Tokenizer(ref.path)
    prompts = {w: [tok.apply_chat_template(p.chat())[0] for p in ps] for w, ps in chosen.items()}
    cache = paths.cache / "bench" / "replay-answers.json"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    keys = {w: [_answer_key(ref, t, args.tokens) for t in ps] for w, ps in prompts.items()}
    n_ctx = max(len(t) for ps in prompts.values() for t in ps) + args.tokens + MEASURED_DRAFTS[-1] + 8
    engine = StageEngine(EngineConfig(ref.path, n_ctx=n_ctx, n_batch=64, n_seq_max=1, n_threads=args.threads))
    answers: dict[str, list[list[int]]] = {}
    try:
        for w, ps in prompts.items():
            todo = sum(k not in known for k in keys[w])
            print(f"  {w}: {len(ps)} prompt(s), decoding {todo} greedy answer(s) (others cached)",
                  file=sys.stderr, flush=True)
            for i, (p, k) in enumerate(zip(ps, keys[w])):
                if k not in known:
                    known[k] = _greedy(engine, p, args.tokens, tok.eog_ids)
                    print(f"    {i + 1}/{len(ps)}", file=sys.stderr, flush=True)
                    _save(cache, known)   # an interrupted run keeps what it decoded
            answers[w] = [known[k] for k in keys[w]]
        if args.step_ms is None:
            print("  measuring step costs", file=sys.stderr, flush=True)
            step_ms = _step_costs(engine, prompts["code_edit"][0], MEASURED_DRAFTS)
            hop_ms = args.hop_ms
        else:
            step_ms, hop_ms = args.step_ms, 0.0
    finally:
        engine.close()

    draft = None
    draft_ms = args.draft_ms or 0.0
    if any(p in DRAFTING for p in args.proposers):
        from meshnode.bench.spec_bench import derived_model
        from meshnode.spec.draft import DraftModelProposer

        draft = DraftModelProposer(derived_model(ref, paths, "Q4_0", "draft"), n_ctx=n_ctx, n_batch=64,
                                   n_threads=args.threads, stop_ids=tok.eog_ids)
        if args.draft_ms is None:
            print("  measuring the draft's step cost", file=sys.stderr, flush=True)
            draft_ms = _step_costs(draft.engine, prompts["code_edit"][0], (0,))[0]
    tok.close()

    cost = CostModel(step_s=step_ms[0] / 1000)
    for k, ms in step_ms.items():
        cost.observe(k, (hop_ms + ms) / 1000)
    min_matches = args.min_match or [None]
    print(f"replay: {ref.name}, set {args.split}{' (quick)' if args.quick else ''}, {args.threads} "
          f"thread(s), " + (f"hop {hop_ms:g} ms" if args.step_ms is None else "step costs as given")
          + "; step ms by drafts " + " ".join(f"{k}:{1000 * cost.seconds(k):.1f}" for k in (0, 1, 2, 4, 8, 16))
          + (f"; a draft call {draft_ms:.2f} ms" if draft is not None else ""))
    configs = []
    for name in args.proposers:
        if name == "draft":
            configs.append(("draft", name, args.max_n[0], None, min_matches[0], True))
            continue
        for max_n in args.max_n:
            for hmin in ((args.history_min or [HISTORY_MIN_MATCH]) if name != "ngram" else [None]):
                for mm in min_matches:
                    for cursor in args.cursor:
                        label = (f"{name}/{max_n}" + (f"/h{hmin}" if hmin is not None else "")
                                 + (f"/m{mm or 'auto'}" if args.min_match else "")
                                 + (f"/c-{'on' if cursor else 'off'}" if len(args.cursor) > 1 else ""))
                        configs.append((label, name, max_n, hmin, mm, cursor))
    print(f"{'workload':11s} {'proposer':16s} {'steps':>6s} {'plain':>6s} {'windows':>7s} {'drafts':>7s} "
          f"{'accepted':>8s} {'accept':>7s} {'acc/win':>7s} {'predicted':>10s}")
    result: dict = {"step_ms": {str(k): round(v, 3) for k, v in step_ms.items()}}
    for w in prompts:
        result[w] = {}
        for label, name, max_n, hmin, mm, cursor in configs:
            r = replay(prompts[w], answers[w], max_n, cost, mm, cursor=cursor,
                       clients=[p.client for p in chosen[w]] if name != "ngram" else None,
                       kinds=[p.kind for p in chosen[w]], history_min=hmin, max_window=args.max_window,
                       draft=draft if name in DRAFTING else None, draft_ms=draft_ms,
                       n_gram=name != "draft", split_windows=name == "hybrid-split")
            result[w][label] = r
            print(f"{w:11s} {label:16s} {r['steps']:6d} {r['plain_steps']:6d} {r['windows']:7d} "
                  f"{r['drafts']:7d} {r['accepted']:8d} {r['acceptance']:7.2f} "
                  f"{r['accepted_per_window']:7.2f} {r['predicted_speedup']:9.3f}x")
        kinds = sorted(result[w][configs[0][0]]["kinds"])
        print(f"  {w} by kind, accepted tokens per verify round (acceptance): "
              + "; ".join(f"{k}: " + " / ".join(
                  f"{result[w][c[0]]['kinds'][k]['accepted_per_window']:.2f} "
                  f"({result[w][c[0]]['kinds'][k]['acceptance']:.2f})" for c in configs) for k in kinds)
              + f"  [{' / '.join(c[0] for c in configs)}]")
    if draft is not None:
        draft.close()
        result["draft_ms"] = round(draft_ms, 3)
    if args.json:
        print(json.dumps(result))
    return 0


def _save(cache, known: dict) -> None:
    import json
    import os

    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(known))
    os.replace(tmp, cache)


def _answer_key(ref, prompt: list[int], max_tokens: int) -> str:
    import hashlib

    h = hashlib.sha256(f"{ref.name}|{ref.path.stat().st_size}|{max_tokens}|".encode())
    h.update(",".join(map(str, prompt)).encode())
    return h.hexdigest()[:32]


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


def replay(prompts: list[list[int]], answers: list[list[int]], max_n: int, cost, min_match: int | None, *,
           clients: list[str] | None = None, kinds: list[str] | None = None,
           history_min: int | None = None, max_window: int | None = None,
           draft=None, draft_ms: float = 0.0, n_gram: bool = True, split_windows: bool = False,
           cursor: bool = True) -> dict:
    """Replay known greedy ``answers`` through a proposer and the serving loop's default
    window (one window for all prompts, as in one server): what drafting would do, and
    what it would cost by ``cost`` (a CostModel of the true step costs). The window is
    sized as a node sizes it, by a cost model that starts from the default prior and
    learns every step's cost as it goes. ``clients`` (one per prompt): use the suffix
    proposer, each prompt drafting also from the earlier texts of its client, as a server
    remembers them; None: the n-gram proposer. ``cursor``: the proposer keeps its copy
    cursor (spec/ngram.py).

    ``draft`` (a DraftModelProposer): drafts where the n-gram proposer has none (or
    always, without ``n_gram``), each of its windows charged ``draft_ms`` per call the
    draft made for it; with ``split_windows`` its windows have a controller and a learned
    cost model of their own (else they share the n-gram window's)."""
    from meshnode.spec.cost_model import CostModel
    from meshnode.spec.ngram import NGramProposer, min_match_for
    from meshnode.spec.suffix import HISTORY_MIN_MATCH, RecentTexts, SuffixProposer
    from meshnode.spec.window import WindowPolicy, make_window

    policy = WindowPolicy() if max_window is None else WindowPolicy().at_most(max_window)
    learned = CostModel(hop_s=0.0)       # as serve/speculation.py makes it
    window = make_window(policy, learned)
    draft_learned = CostModel(hop_s=0.0) if split_windows else learned
    draft_window = make_window(policy, draft_learned) if split_windows else window
    recent = RecentTexts(max_clients=1 << 20, max_age_s=1e18) if clients is not None else None
    total = _Tally()
    by_kind: dict[str, _Tally] = {}
    for j, (prompt, answer) in enumerate(zip(prompts, answers)):
        if recent is not None:
            assert clients is not None
            ngram = SuffixProposer(prompt, recent.automaton(clients[j], float(j)), max_n=max_n,
                                   history_min=history_min or HISTORY_MIN_MATCH, cursor=cursor)
        else:
            ngram = NGramProposer(prompt, max_n=max_n, cursor=cursor)
        if draft is not None:
            draft.reset(prompt)        # its prefill is the request's, not a step's
        mine = by_kind.setdefault(kinds[j] if kinds else "all", _Tally())
        i = 0
        while i < len(answer):
            k = window.next_window()
            mm = min_match or min_match_for(learned.window_steps)
            proposal = ngram.propose(k, min_match=mm) if n_gram else []
            used, model, seconds = window, learned, 0.0
            if not proposal and draft is not None:
                used, model = draft_window, draft_learned
                calls = draft.stats.calls
                proposal = draft.propose([], draft_window.next_window() if split_windows else k)
                seconds = (draft.stats.calls - calls) * draft_ms / 1000
            n = 0
            while n < len(proposal) and i + n < len(answer) and proposal[n] == answer[i + n]:
                n += 1
            seconds += cost.seconds(len(proposal))
            if proposal:
                used.update(len(proposal), n)
                model.observe(len(proposal), seconds)
            else:
                # a plain step: what every window is weighed against
                learned.observe(0, seconds)
                if draft_learned is not learned:
                    draft_learned.observe(0, seconds)
            new = answer[i:i + n + 1]
            ngram.observe(new)
            if draft is not None:
                draft.accept(new)
            i += len(new)
            for t in (total, mine):
                t.add(len(proposal), n, seconds)
        for t in (total, mine):
            t.tokens += len(answer)
        if recent is not None:
            recent.add(clients[j], [*prompt, *answer], float(j))
    out = total.summary(cost)
    out["kinds"] = {k: t.summary(cost) for k, t in sorted(by_kind.items())}
    return out


class _Tally:
    def __init__(self) -> None:
        self.steps = self.plain = self.windows = self.drafts = self.accepted = self.tokens = 0
        self.spent = 0.0

    def add(self, k: int, n: int, seconds: float) -> None:
        self.steps += 1
        self.plain += not k
        self.windows += bool(k)
        self.drafts += k
        self.accepted += n
        self.spent += seconds

    def summary(self, cost) -> dict:
        return {"steps": self.steps, "plain_steps": self.plain, "windows": self.windows,
                "drafts": self.drafts, "accepted": self.accepted,
                "acceptance": round(self.accepted / self.drafts, 3) if self.drafts else 0.0,
                "accepted_per_window": round(self.accepted / self.windows, 3) if self.windows else 0.0,
                "tokens": self.tokens,
                "predicted_speedup": round(self.tokens * cost.seconds(0) / self.spent, 3) if self.spent else 1.0}
