"""Time a draft model's calls on this machine: ``python packaging/gpu/draft_probe.py DRAFT.gguf``
(``--smol-shape``: first write DRAFT.gguf, a random Q4_0 model of SmolLM2-135M's shape).

Loads the draft as a node does (DraftModelProposer, every layer offloaded when a GPU is
there), prefills a 600-token prompt, then times propose(k) + accept for k = 1..3 and a
bare one-row engine step, printing milliseconds per call."""
import sys
import time

from meshnode.engine.offload import GPU_LAYERS_ALL, gpu_devices
from meshnode.spec.draft import DraftModelProposer


def main() -> int:
    path = sys.argv[1]
    if "--smol-shape" in sys.argv[2:]:
        from meshnode.engine.quantize import requantize
        from meshnode.models.synthetic import SyntheticSpec, write_synthetic_gguf

        write_synthetic_gguf(path + ".f16", SyntheticSpec(n_layer=30, n_embd=576, n_head=9, n_kv_head=3,
                                                          n_ff=1536, vocab=49152, dtype="f16"))
        requantize(path + ".f16", path, "Q4_0")
    gl = GPU_LAYERS_ALL if gpu_devices() else 0
    d = DraftModelProposer(path, n_ctx=4096, n_batch=256, n_threads=1, gpu_layers=gl)
    print(f"backend {d.engine.backend}, gpu layers {d.engine.gpu_layers}, pad rows {d.engine.pad_rows}", flush=True)
    prompt = [(i * 7919) % 40000 + 100 for i in range(600)]
    t = time.perf_counter()
    d.reset(prompt)
    print(f"prefill 600: {1e3 * (time.perf_counter() - t):.1f} ms", flush=True)
    for k in (1, 2, 3):
        times = []
        for _ in range(20):
            t = time.perf_counter()
            drafts = d.propose([], k)
            times.append(time.perf_counter() - t)
            d.accept(drafts + [drafts[-1]])   # all accepted plus a bonus
        times.sort()
        print(f"propose k={k}: median {1e3 * times[10]:.2f} ms, min {1e3 * times[0]:.2f} ms "
              f"(calls so far {d.stats.calls})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
