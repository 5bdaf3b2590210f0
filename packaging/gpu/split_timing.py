"""Where a split's extra time goes, in one process (no network): ms per decode step of the
whole model, of slice A (the first half; the capture tap stops its graph after its last
layer), of slice A with its tied head and no tap (the whole graph runs), and of slice B
(from embeddings), each with one-row steps unpadded and padded. ``decode`` is the time
inside llama_decode, ``step`` the engine's whole forward (input copy, capture, rollback).
Run it once per environment setting (GGML_CUDA_DISABLE_GRAPHS, LLAMA_GRAPH_REUSE_DISABLE
are read by llama.cpp at start). One JSON line per engine and pad width.

    python packaging/gpu/split_timing.py MODEL.gguf [LABEL] [PADS]
"""
import json
import sys
import time
from pathlib import Path

import numpy as np

import llama_cpp
from meshnode.engine import EngineConfig, Segment, StageEngine
from meshnode.engine import stage as stage_mod
from meshnode.engine.offload import GPU_LAYERS_ALL
from meshnode.models.slicer import SliceCache
from meshnode.models.store import resolve_model
from meshnode.paths import NodePaths

path = Path(sys.argv[1])
label = sys.argv[2] if len(sys.argv) > 2 else "default"
pads = [int(p) for p in (sys.argv[3] if len(sys.argv) > 3 else "1,2,8").split(",")]
paths = NodePaths.resolve(None).ensure()
ref = resolve_model(str(path), paths)
half = ref.n_layers // 2
cache = SliceCache(paths)
a_path, b_path = cache.get(ref, 0, half), cache.get(ref, half, ref.n_layers)

decode_s = [0.0]
_real = llama_cpp.llama_decode


def timed(ctx, batch):
    t0 = time.perf_counter()
    rc = _real(ctx, batch)
    decode_s[0] += time.perf_counter() - t0
    return rc


stage_mod.llama_cpp.llama_decode = timed   # stage.py calls llama_cpp.llama_decode
N, CTX = 64, 32
rng = np.random.default_rng(0)


def bench(name, cfg, tokens):
    for pad in pads:
        eng = StageEngine(EngineConfig(**cfg, n_ctx=CTX + N + 40, n_batch=64, n_seq_max=1,
                                       gpu_layers=GPU_LAYERS_ALL, pad_rows=pad))
        if tokens:
            pre = Segment(0, 0, tokens=rng.integers(0, 1000, CTX, dtype=np.int32), n_logits=1 if eng.has_head else 0)
        else:
            pre = Segment(0, 0, hidden=rng.standard_normal((CTX, eng.n_embd), dtype=np.float32),
                          n_logits=1 if eng.has_head else 0)
        eng.forward([pre])
        rows = ([Segment(0, CTX + i, tokens=np.asarray([100 + i], np.int32), n_logits=1 if eng.has_head else 0)
                 for i in range(N)] if tokens else
                [Segment(0, CTX + i, hidden=rng.standard_normal((1, eng.n_embd), dtype=np.float32),
                         n_logits=1 if eng.has_head else 0) for i in range(N)])
        for rep in range(2):   # the first pass warms up (CUDA graph capture), the second is timed
            eng.rollback(0, CTX)
            decode_s[0] = 0.0
            t0 = time.perf_counter()
            for s in rows:
                eng.forward([s])
            wall = time.perf_counter() - t0
        print(json.dumps({"env": label, "engine": name, "pad": pad, "step_ms": round(1e3 * wall / N, 3),
                          "decode_ms": round(1e3 * decode_s[0] / N, 3)}), flush=True)
        eng.close()


bench("whole", dict(path=ref.path), True)
bench("A tap", dict(path=a_path, takes_tokens=True, has_head=False), True)
bench("A head, no tap", dict(path=a_path, takes_tokens=True, has_head=True), True)
bench("B from embd", dict(path=b_path, takes_tokens=False, has_head=True), False)
