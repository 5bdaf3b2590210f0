"""Which batch shapes agree on a GPU? For a model and flash-attention setting, decode the
same 32 tokens after a 200-token context as windows of 2, 4, 8, 16 and 32 rows, as one-row
steps, and as one-row steps padded with a row of a second (scratch) session, and print
each one's max |logit diff| against the 2-row windows (one JSON line per setting).

    python packaging/gpu/window_probe.py MODEL.gguf [on|off|auto]
"""
import json
import sys
from pathlib import Path

import numpy as np

from meshnode.engine import EngineConfig, Segment, StageEngine
from meshnode.engine.offload import GPU_LAYERS_ALL

path = Path(sys.argv[1])
fa = {"on": True, "off": False, "auto": None}[sys.argv[2] if len(sys.argv) > 2 else "auto"]
eng = StageEngine(EngineConfig(path, n_ctx=400, n_batch=64, n_seq_max=2, gpu_layers=GPU_LAYERS_ALL, flash_attn=fa))
rng = np.random.default_rng(0)
stream = rng.integers(0, eng.n_vocab, size=300, dtype=np.int32)
CTX, N = 200, 32
steps = stream[CTX:CTX + N]


def run(shape):
    eng.rollback(0, CTX)
    out = []
    if shape == "one":
        for i in range(N):
            out.append(eng.forward([Segment(0, CTX + i, tokens=steps[i:i + 1], n_logits=1)])[0])
    elif shape == "padded":
        for i in range(N):
            eng.rollback(1, 16)
            out.append(eng.forward([Segment(0, CTX + i, tokens=steps[i:i + 1], n_logits=1),
                                    Segment(1, 16, tokens=stream[:1], n_logits=0)])[0])
    else:
        for a in range(0, N, shape):
            rows = steps[a:a + shape]
            out.append(eng.forward([Segment(0, CTX + a, tokens=rows, n_logits=len(rows))])[0])
    return np.concatenate(out)


eng.run_session(0, 0, stream[:CTX], n_logits=1)
eng.run_session(1, 0, stream[:16], n_logits=0)
ref = run(2)
res = {"model": path.name, "flash_attn": sys.argv[2] if len(sys.argv) > 2 else "auto"}
for shape in (2, 4, 8, 16, 32, "one", "padded"):
    got = run(shape)
    res[str(shape)] = float(np.max(np.abs(got - ref)))
print(json.dumps(res), flush=True)
eng.close()
