"""What moving a session's KV between streams costs on this machine:
``python packaging/gpu/copy_probe.py MODEL [CONTEXT]``.

A whole model (every layer offloaded when a GPU is there), four session slots, one
session holding a CONTEXT-token prompt (default 1000). Prints the median milliseconds of:

* ``step``: a one-row step of that session (plain decoding);
* ``step after a copy``: the same step right after the session was copied into another
  stream (what a prefix-cache ``SessionCopy`` does, and a move of a session onto a free
  id: llama.cpp copies the streams, then reserves a new worst-case graph, in that decode);
* ``swap through host``: two sessions trading ids with no id free (``llama_state_seq_get/
  set_data`` of both), which a CPU engine does to pack a call and a GPU engine no longer
  does (docs/engine.md, "Sessions together").
"""
import statistics
import sys
import time

import numpy as np

from meshnode.engine import EngineConfig, Segment, StageEngine
from meshnode.engine.offload import GPU_LAYERS_ALL, gpu_devices


def main() -> int:
    path = sys.argv[1]
    context = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    gl = GPU_LAYERS_ALL if gpu_devices() else 0
    e = StageEngine(EngineConfig(path, n_ctx=4096, n_batch=256, n_seq_max=4, n_threads=1, gpu_layers=gl))
    print(f"backend {e.backend}, gpu layers {e.gpu_layers}, a session of {context} tokens", flush=True)
    rng = np.random.default_rng(0)
    tok = lambda n: rng.integers(100, 40000, n).astype(np.int32)
    pos = {}
    for s in (1, 2, 3, 4):   # every slot taken: a swap has no free id to go through
        pos[s] = 0
        while pos[s] < context:
            n = min(256, context - pos[s])
            e.forward([Segment(s, pos[s], tokens=tok(n), n_logits=1)])
            pos[s] += n

    def step(s: int = 1) -> float:
        t = time.perf_counter()
        e.forward([Segment(s, pos[s], tokens=tok(1), n_logits=1)])
        pos[s] += 1
        return time.perf_counter() - t

    ms = lambda xs: f"{1e3 * statistics.median(xs):.2f}"
    plain = [step() for _ in range(20)]
    after = []
    for _ in range(8):
        e.drop(4)
        e.copy(1, 4, pos[1])
        pos[4] = pos[1]
        after.append(step())
        plain.append(step())
    swaps = []
    for _ in range(8):
        t = time.perf_counter()
        assert e._swap(1, 2)   # noqa: SLF001 - the move the engine makes to pack a call
        swaps.append(time.perf_counter() - t)
        step()   # the swapped streams in use again
    print(f"step {ms(plain)} ms; step after a copy {ms(after)} ms; swap through host {ms(swaps)} ms",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
