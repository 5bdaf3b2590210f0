"""Which ways of batching sessions together give each session its answer alone, on a GPU?

Eight sessions sit at contexts in three 256-cell KV buckets (docs/engine.md "GPU"). Each
decodes the same 16 tokens: alone, one-row steps (padded by the engine as always), as the
reference; then together, one step of every session per round, batched several ways:

- ``engine``: ``StageEngine.forward`` with all eight, what a node does (on a GPU engine
  it splits them into calls that compute every row as alone: ``_alone_alike_groups``);
- ``one call``: all eight in one llama.cpp call (llama.cpp's own batching);
- ``by4``/``by2``: at most 4 or 2 sessions per call, in their order (buckets mixed);
- ``bucket4``/``bucket2``: at most 4 or 2 per call, only sessions of one bucket;
- ``bucket2x2``: at most 2 per call, one bucket, each session's row padded to 2 rows;
- ``by2x2``: the same with buckets mixed (does the bucket matter for a padded pair?);
- ``serial``: one session per call (what alone means; 0 by construction).

One JSON line: per batching the max |logit diff| against alone, how many sessions differ
and the median ms of a round (eight tokens).

    python packaging/gpu/batch_probe.py MODEL.gguf [gpu layers, default all]
"""
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from meshnode.engine import EngineConfig, Segment, StageEngine
from meshnode.engine.offload import GPU_LAYERS_ALL
from meshnode.limits import KV_BUCKET

path = Path(sys.argv[1])
layers = GPU_LAYERS_ALL if len(sys.argv) < 3 or sys.argv[2] == "all" else int(sys.argv[2])
CTXS = (100, 120, 140, 160, 300, 320, 600, 620)
N = 16
eng = StageEngine(EngineConfig(path, n_ctx=768, n_batch=64, n_seq_max=len(CTXS), gpu_layers=layers))
rng = np.random.default_rng(0)
streams = [rng.integers(0, eng.n_vocab, size=c + N, dtype=np.int32) for c in CTXS]
for s, c in enumerate(CTXS):
    for a in range(0, c, 64):
        eng.forward([Segment(s, a, tokens=streams[s][a:min(c, a + 64)], n_logits=0)])


def bucket(s: int, i: int) -> int:
    return -(-(CTXS[s] + i + eng.pad_rows) // KV_BUCKET)


def groups(kind: str, i: int) -> list[list[int]]:
    ids = list(range(len(CTXS)))
    if kind == "serial":
        return [[s] for s in ids]
    if kind in ("engine", "one call"):
        return [ids]
    width = 2 if kind.endswith("x2") else int(kind[-1])
    if kind.startswith("by"):
        return [ids[a:a + width] for a in range(0, len(ids), width)]
    out: list[list[int]] = []
    for b in sorted({bucket(s, i) for s in ids}):
        same = [s for s in ids if bucket(s, i) == b]
        out += [same[a:a + width] for a in range(0, len(same), width)]
    return out


def run(kind: str) -> tuple[list[np.ndarray], float]:
    for s, c in enumerate(CTXS):
        eng.rollback(s, c)
    got = [[] for _ in CTXS]
    ms = []
    for i in range(N):
        t0 = time.perf_counter()
        for g in groups(kind, i):
            rows = 2 if kind.endswith("x2") and len(g) > 1 else 1
            segs = [Segment(s, CTXS[s] + i, tokens=np.repeat(streams[s][CTXS[s] + i:CTXS[s] + i + 1], rows),
                            n_logits=rows) for s in g]
            # several sessions: one raw llama.cpp call, except "engine" (the node's path)
            call = eng.forward if len(g) == 1 or kind == "engine" else eng._forward
            for s, out in zip(g, call(segs)):
                got[s].append(out[:1])
                eng.rollback(s, CTXS[s] + i + 1)
        ms.append(1e3 * (time.perf_counter() - t0))
    return [np.concatenate(x) for x in got], statistics.median(ms)


ref, _ = run("serial")
res: dict = {"model": path.name, "pad_rows": eng.pad_rows, "backend": eng.backend}
for kind in ("serial", "engine", "one call", "by4", "by2", "bucket4", "bucket2", "bucket2x2", "by2x2"):
    got, ms = run(kind)
    d = [float(np.max(np.abs(g - r))) for g, r in zip(got, ref)]
    res[kind] = {"max_diff": max(d), "sessions_differ": sum(x > 0 for x in d), "ms_per_round": round(ms, 2)}
print(json.dumps(res), flush=True)
eng.close()
