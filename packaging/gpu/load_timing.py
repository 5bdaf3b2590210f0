"""What a re-plan saves a stage that keeps its layer range: seconds to load an engine
(weights read and, with --gpu-layers, uploaded) against taking it back from the node's
EngineShelf (meshnode/engine/shelf.py), for the whole model and its two halves. The
first load of each reads the file from disk; the others from the page cache, as a
re-plan moments after the first load does. One JSON line per engine.

    python packaging/gpu/load_timing.py MODEL.gguf [GPU_LAYERS (default all)] [REPS]
"""
import asyncio
import json
import sys
import time
from pathlib import Path

from meshnode.engine import EngineConfig
from meshnode.engine.offload import GPU_LAYERS_ALL
from meshnode.engine.shelf import EngineShelf
from meshnode.models.slicer import SliceCache
from meshnode.models.store import resolve_model
from meshnode.paths import NodePaths

path = Path(sys.argv[1])
gpu = GPU_LAYERS_ALL if len(sys.argv) < 3 or sys.argv[2] == "all" else int(sys.argv[2])
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
paths = NodePaths.resolve(None).ensure()
ref = resolve_model(str(path), paths)
half = ref.n_layers // 2
cache = SliceCache(paths)
engines = {
    "whole": EngineConfig(path, gpu_layers=gpu, n_ctx=2048, n_batch=64, n_seq_max=4, n_threads=4),
    "first half": EngineConfig(cache.get(ref, 0, half), has_head=False, gpu_layers=gpu, n_ctx=2048,
                               n_batch=64, n_seq_max=4, n_threads=4),
    "second half": EngineConfig(cache.get(ref, half, ref.n_layers), takes_tokens=False, gpu_layers=gpu,
                                n_ctx=2048, n_batch=64, n_seq_max=4, n_threads=4),
}


async def main() -> None:
    for label, config in engines.items():
        shelf = EngineShelf()
        loads, takes = [], []
        for _ in range(reps):
            await shelf.clear()                       # nothing parked: a fresh load
            t0 = time.perf_counter()
            worker = await shelf.load(config, label)
            loads.append(time.perf_counter() - t0)
            await worker.close()                      # parked (reset)
            t0 = time.perf_counter()
            worker = await shelf.load(config, label)  # taken back
            takes.append(time.perf_counter() - t0)
            await worker.close()
        await shelf.close()
        print(json.dumps({"engine": label, "gpu_layers": gpu, "file_mb": round(config.path.stat().st_size / 2**20),
                          "load_s": [round(x, 3) for x in loads], "taken_back_ms": [round(x * 1e3, 2) for x in takes],
                          "reused": shelf.reused}), flush=True)


asyncio.run(main())
