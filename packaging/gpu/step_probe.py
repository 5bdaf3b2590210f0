"""Time one engine's call patterns on this machine (why a draft model's one-row decodes
cost more than its two-row catch-up on a GPU): ``python packaging/gpu/step_probe.py MODEL [PAD]``.

A whole model, every layer offloaded when a GPU is there, ``PAD`` rows of padding (default:
the engine's). After a 600-token prefill, each pattern runs 30 times and prints the
median milliseconds of each call kind:

* ``steps``: one-row steps in a row (plain decoding);
* ``draft``: what a draft model's proposal does: a 2-row catch-up (logits of its last
  row), then two one-row steps, then a rollback of 3 rows (the next catch-up re-feeds);
* ``two-row``: 2-row calls in a row (logits of the last row);
* ``rollback``: one-row step, rollback of that row, the same step again.
"""
import statistics
import sys
import time

import numpy as np

from meshnode.engine import EngineConfig, Segment, StageEngine
from meshnode.engine.offload import GPU_LAYERS_ALL, gpu_devices


def main() -> int:
    path = sys.argv[1]
    pad = int(sys.argv[2]) if len(sys.argv) > 2 else None
    gl = GPU_LAYERS_ALL if gpu_devices() else 0
    e = StageEngine(EngineConfig(path, n_ctx=4096, n_batch=256, n_seq_max=1, n_threads=1,
                                 gpu_layers=gl, pad_rows=pad))
    print(f"backend {e.backend}, gpu layers {e.gpu_layers}, pad rows {e.pad_rows}", flush=True)
    if e.call_shapes is not None:   # what the engine timed at load, and its choice
        print(f"call shapes at load: {e.call_shapes.summary()}; stays wide after a window: "
              f"{e.call_shapes.wide_wins}", flush=True)
    rng = np.random.default_rng(0)
    tok = lambda n: rng.integers(100, 40000, n).astype(np.int32)
    pos = 0
    for start in range(0, 600, 256):
        n = min(256, 600 - start)
        e.forward([Segment(0, pos, tokens=tok(n), n_logits=1)])
        pos += n

    def call(n: int, n_logits: int = 1) -> float:
        nonlocal pos
        t = time.perf_counter()
        e.forward([Segment(0, pos, tokens=tok(n), n_logits=n_logits)], rewind=True)
        pos += n
        return time.perf_counter() - t

    def back(n: int) -> float:
        nonlocal pos
        t = time.perf_counter()
        e.rollback(0, pos - n)
        pos -= n
        return time.perf_counter() - t

    ms = lambda xs: f"{1e3 * statistics.median(xs):.2f}"
    s = [call(1) for _ in range(30)]
    print(f"steps: one-row {ms(s)} ms", flush=True)
    c, a, b, r = [], [], [], []
    for _ in range(30):
        c.append(call(2)); a.append(call(1)); b.append(call(1)); r.append(back(3))
    print(f"draft: catch-up 2 rows {ms(c)}, then one-row {ms(a)} and {ms(b)}, rollback {ms(r)} ms", flush=True)
    s = [call(2) for _ in range(30)]
    print(f"two-row: {ms(s)} ms", flush=True)
    a, r, b = [], [], []
    for _ in range(30):
        a.append(call(1)); r.append(back(1)); b.append(call(1))
    print(f"rollback: one-row {ms(a)}, rollback {ms(r)}, again {ms(b)} ms", flush=True)
    e.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
