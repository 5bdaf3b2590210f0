"""`meshnode bench sample`: what picking one token costs the final stage, per sampling
setting, against greedy decoding in the same invocation.

The rows are the model's own logits after a few prompts (code, a story, a question: real
distributions are peaked, which top-p's shortcut relies on) and a random N(0, 3) row of
the same vocabulary (flat: top-p's worst case). Each setting runs the final stage's
``FinalSampler.finalize`` on one row (penalties, then ``meshnode.spec.acceptance``), the
penalties with what a step carries for a long answer (``PENALTY_IDS`` distinct tokens
seen; the repetition penalty over the whole context, or its last 64 tokens); the time is
the median of 5 batches, in microseconds per token, and the ratio is against greedy on the
same row.
"""

from __future__ import annotations

import argparse
import json
import sys

from meshnode.argtypes import positive_int

HELP = "cost of sampling one token (temperature, top-p, top-k, penalties) against greedy, on a model's logits"

PROMPTS = {
    "code": "def parse_csv(path):\n    ",
    "story": "Once upon a time, in a small village by the sea,",
    "question": "The capital of France is",
}
SETTINGS = {   # name -> Sampling fields
    "greedy": {},
    "T=0.7": {"temperature": 0.7},
    "T=0.7 top_p=0.9": {"temperature": 0.7, "top_p": 0.9},
    "T=1 top_p=0.95": {"temperature": 1.0, "top_p": 0.95},
    "T=0.7 top_k=40": {"temperature": 0.7, "top_k": 40},
    "presence+freq": {"presence": 0.5, "frequency": 0.5},
    "repeat last 64": {"repeat": 1.1, "repeat_last_n": 64},
    "repetition all": {"repeat": 1.1, "repeat_last_n": -1},
}
# distinct tokens a penalized step carries (a ~1000-token context's, an answer's counts)
PENALTY_IDS = 400


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF or store name (default: the default model)")
    p.add_argument("--iters", type=positive_int, default=100, help="tokens per batch (default 100)")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from meshnode.models.store import resolve_model
    from meshnode.paths import NodePaths

    ref = resolve_model(args.model, NodePaths.resolve(args.home).ensure())
    rows = _logits(ref.path)
    vocab = next(iter(rows.values())).size
    rows["random"] = (np.random.default_rng(0).standard_normal(vocab) * 3).astype(np.float32)
    res = {name: {s: _time(row, SETTINGS[s], args.iters) for s in SETTINGS} for name, row in rows.items()}
    print(f"meshnode bench sample: {ref.name}, vocabulary {vocab}; us per token (median of 5 batches of "
          f"{args.iters}), ratio against greedy on the same row")
    print(f"{'row':<10}" + "".join(f"{s:>18}" for s in SETTINGS))
    for name, by in res.items():
        print(f"{name:<10}" + "".join(f"{by[s]:>9.1f} {by[s] / by['greedy']:>6.1f}x " for s in SETTINGS))
    if args.json:
        print(json.dumps({"model": ref.name, "vocab": vocab, "us": res}))
    return 0


def _logits(path) -> dict:
    import numpy as np

    from meshnode.engine import EngineConfig, Segment, StageEngine
    from meshnode.engine.tokenizer import Tokenizer

    print(f"  loading {path.name} ...", file=sys.stderr, flush=True)
    tok = Tokenizer(path)
    out = {}
    with StageEngine(EngineConfig(path, n_ctx=256, n_seq_max=1)) as eng:
        for name, prompt in PROMPTS.items():
            ids = np.array(tok.encode(prompt), dtype=np.int32)
            out[name] = eng.forward([Segment(0, 0, tokens=ids, n_logits=1)])[0][-1].copy()
            eng.drop(0)
    return out


def _time(row, fields: dict, iters: int) -> float:
    import statistics
    import time

    import numpy as np

    from meshnode.mesh.final import NO_COUNTS, Counts, FinalSampler, Sampling, recent_tokens

    sampling = Sampling(**fields)
    context = np.random.default_rng(1).permutation(row.size)[:PENALTY_IDS].tolist()
    seen = NO_COUNTS if not sampling.penalized else Counts.of(
        dict.fromkeys(context, 2) if sampling.presence or sampling.frequency else {},
        recent_tokens(context, sampling.repeat_last_n) if sampling.repeats else ())
    sampler = FinalSampler()
    logits = row.reshape(1, -1)

    def one() -> None:
        sampler.finalize(0, logits, (), sampling, seen=seen)

    one()
    batches = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            one()
        batches.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(batches)
