"""`meshnode bench sample`: what picking one token costs the final stage, per sampling
setting, against greedy decoding in the same invocation.

The rows are the model's own logits after a few prompts (code, a story, a question: real
distributions are peaked, which top-p's shortcut relies on) and a random N(0, 3) row of
the same vocabulary (flat: top-p's worst case). Each setting runs
``meshnode.spec.acceptance`` as the final stage does (``greedy_token`` at temperature 0,
``sample`` otherwise); the time is the median of 5 batches, in microseconds per token,
and the ratio is against greedy on the same row.
"""

from __future__ import annotations

import argparse
import json
import sys

from meshnode.argtypes import positive_int

HELP = "cost of sampling one token (temperature, top-p, top-k) against greedy, on a model's logits"

PROMPTS = {
    "code": "def parse_csv(path):\n    ",
    "story": "Once upon a time, in a small village by the sea,",
    "question": "The capital of France is",
}
SETTINGS = {   # name -> (temperature, top_k, top_p)
    "greedy": (0.0, 0, 1.0),
    "T=0.7": (0.7, 0, 1.0),
    "T=0.7 top_p=0.9": (0.7, 0, 0.9),
    "T=1 top_p=0.95": (1.0, 0, 0.95),
    "T=0.7 top_k=40": (0.7, 40, 1.0),
}


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
    res = {name: {s: _time(row, *SETTINGS[s], args.iters) for s in SETTINGS} for name, row in rows.items()}
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


def _time(row, temperature: float, top_k: int, top_p: float, iters: int) -> float:
    import statistics
    import time

    import numpy as np

    from meshnode.spec.acceptance import greedy_token, sample

    rng = np.random.default_rng(0)

    def one() -> int:
        return greedy_token(row) if temperature <= 0 else sample(row, temperature, top_k, top_p, rng)

    one()
    batches = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            one()
        batches.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(batches)
