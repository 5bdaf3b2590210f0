"""Pad widths on a GPU: for each width W, decode the same tokens after a 200-token context
as one-row steps and as windows of 2..W rows (every call padded to W rows), and print
the max |logit diff| of each window width against the one-row steps, with the ms per
one-row step (plain decoding's cost of that width). One JSON line per width.

    python packaging/gpu/pad_probe.py MODEL.gguf [WIDTHS]    (default 1,2,4,8)
"""
import json
import sys
import time
from pathlib import Path

import numpy as np

from meshnode.engine import EngineConfig, Segment, StageEngine
from meshnode.engine.offload import GPU_LAYERS_ALL

path = Path(sys.argv[1])
widths = [int(w) for w in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4,8").split(",")]
CTX, N = 200, 48
for pad in widths:
    eng = StageEngine(EngineConfig(path, n_ctx=CTX + N + 40, n_batch=64, n_seq_max=1,
                                   gpu_layers=GPU_LAYERS_ALL, pad_rows=pad))
    rng = np.random.default_rng(0)
    stream = rng.integers(0, eng.n_vocab, size=CTX + N, dtype=np.int32)
    steps = stream[CTX:]
    eng.run_session(0, 0, stream[:CTX], n_logits=1)

    def run(width):
        eng.rollback(0, CTX)
        out = []
        for a in range(0, N, width):
            rows = steps[a:a + width]
            out.append(eng.forward([Segment(0, CTX + a, tokens=rows, n_logits=len(rows))])[0])
        return np.concatenate(out)

    run(1)   # warm-up
    t0 = time.perf_counter()
    ref = run(1)
    ms = 1e3 * (time.perf_counter() - t0) / N
    res = {"model": path.name, "pad_rows": pad, "ms_per_step": round(ms, 3)}
    for width in sorted({2, 3, 4, 6, 8, 12, 16} | {pad}):
        if width > 1:
            res[f"w{width}"] = float(np.max(np.abs(run(width) - ref)))
    print(json.dumps(res), flush=True)
    eng.close()
