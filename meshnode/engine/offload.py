"""GPU offload: which devices llama.cpp sees, and how many layers of a slice go to them.

Theory of operation. llama.cpp (through ggml's backend registry) lists the devices its
build can use: a CPU build lists only the CPU, a CUDA build adds one device per visible
GPU. :func:`gpu_devices` reads that list through ctypes (name, backend, free and total
memory), so what a node advertises (``state.Capabilities.backend`` / ``free_vram_bytes``)
is what llama.cpp itself will use.

``--gpu-layers`` takes a number, ``all`` or ``auto``. :func:`auto_layers` is the pure rule
behind ``auto``: as many whole layers as fit in the free VRAM after a reserve for compute
buffers, counting each layer's weights (the slice file shared evenly over its layers, the
embeddings and head counted as one more layer each, which over-counts and so errs
towards fitting) and its KV cache for the context the engine allocates.

Exactness across batch schedules (one-row decode steps against multi-row verify windows)
depends on the backend's kernel choices; :func:`backend_env_defaults` sets, before the
first CUDA call, the environment the GPU measurements chose (docs/engine.md, "GPU").
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import llama_cpp

from .ggml import ggml_lib

GPU_LAYERS_AUTO = -1
"""``--gpu-layers auto``: as many layers as the free VRAM holds (0 without a GPU)."""
GPU_LAYERS_ALL = 1 << 20
"""``--gpu-layers all``: every layer and the output head (llama.cpp offloads the head
when the count exceeds the slice's layers)."""

# Kept free on the device beyond weights and KV: llama.cpp's compute buffers (a few
# hundred MiB for a 8B-shaped model at n_batch 64) plus the CUDA context.
RESERVE_BYTES = 768 << 20
RESERVE_FRACTION = 0.05

_CPU_LIKE = {"cpu", "blas", "rpc"}

# Environment for exact speculation per backend (set only when the user has not set it).
BACKEND_ENV: dict[str, dict[str, str]] = {
    # llama.cpp multiplies k-quant and i-quant weights (Q4_K, Q6_K, IQ4_XS, ...) by 8 or
    # more rows of a batch with a tiled kernel of its own (ggml-cpu/tiled), which rounds
    # differently from the one-row kernel: on Gemma 3 270M Q4_K_M a verify window of 8+
    # rows, or a replay in chunks, gave other logits than one-row steps (max |diff| 2.7-4.8,
    # other greedy tokens), so speculation and failover changed the text. Off, every row
    # takes the one-row kernel, as Q4_0/Q4_1/Q8_0 rows always do (docs/engine.md,
    # "Batch invariance"); what it costs is measured there.
    "cpu": {"GGML_CPU_TILED_MM": "0"},
    "cuda": {},
}


@dataclass(frozen=True, slots=True)
class GpuDevice:
    name: str          # e.g. "CUDA0"
    description: str   # e.g. "NVIDIA H200"
    backend: str       # lower-case registry name: "cuda", "metal", "vulkan", ...
    free_bytes: int
    total_bytes: int


@cache
def _lib() -> ctypes.CDLL | None:
    try:
        lib = ggml_lib("libggml.so", "libggml.")
        base = ggml_lib("libggml-base", "libggml-base")
    except OSError:
        return None
    vp = ctypes.c_void_p
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = vp
    base.ggml_backend_dev_name.argtypes = [vp]
    base.ggml_backend_dev_name.restype = ctypes.c_char_p
    base.ggml_backend_dev_description.argtypes = [vp]
    base.ggml_backend_dev_description.restype = ctypes.c_char_p
    base.ggml_backend_dev_type.argtypes = [vp]
    base.ggml_backend_dev_type.restype = ctypes.c_int
    base.ggml_backend_dev_memory.argtypes = [vp, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    base.ggml_backend_dev_memory.restype = None
    base.ggml_backend_dev_backend_reg.argtypes = [vp]
    base.ggml_backend_dev_backend_reg.restype = vp
    base.ggml_backend_reg_name.argtypes = [vp]
    base.ggml_backend_reg_name.restype = ctypes.c_char_p
    lib._base = base  # type: ignore[attr-defined]
    return lib


def gpu_devices() -> list[GpuDevice]:
    """The GPU devices of this llama.cpp build, with their free memory now ([] on a
    CPU-only build, or when CUDA sees no device)."""
    if not llama_cpp.llama_supports_gpu_offload():
        return []
    lib = _lib()
    if lib is None:
        return []
    base = lib._base  # type: ignore[attr-defined]
    out = []
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        if not dev or base.ggml_backend_dev_type(dev) == 0:   # GGML_BACKEND_DEVICE_TYPE_CPU
            continue
        reg = base.ggml_backend_dev_backend_reg(dev)
        backend = (base.ggml_backend_reg_name(reg) or b"gpu").decode(errors="replace").lower() if reg else "gpu"
        if backend in _CPU_LIKE:
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(GpuDevice((base.ggml_backend_dev_name(dev) or b"").decode(errors="replace"),
                             (base.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                             backend, int(free.value), int(total.value)))
    return out


def backend_summary() -> tuple[str, int]:
    """(backend, free VRAM bytes summed over its devices): ("cpu", 0) without a GPU."""
    devs = gpu_devices()
    if not devs:
        return "cpu", 0
    return devs[0].backend, sum(d.free_bytes for d in devs)


def auto_layers(*, file_bytes: int, n_layer: int, kv_bytes_per_layer: int, free_vram: int,
                reserve: int | None = None) -> int:
    """How many of a slice's ``n_layer`` layers fit in ``free_vram`` bytes (pure).

    Returns ``n_layer + 1`` (every layer and the head) when everything fits, else the
    whole layers that fit (0 when none does)."""
    if n_layer < 1 or free_vram <= 0:
        return 0
    if reserve is None:
        reserve = RESERVE_BYTES + int(free_vram * RESERVE_FRACTION)
    usable = free_vram - reserve
    per_layer = file_bytes / (n_layer + 2) + kv_bytes_per_layer   # + embeddings + head
    if usable <= 0 or per_layer <= 0:
        return 0
    if per_layer * (n_layer + 2) <= usable:
        return n_layer + 1
    return max(0, min(n_layer, int(usable // per_layer)))


def resolve_gpu_layers(requested: int, *, file_bytes: int,
                       shape: Callable[[], tuple[int, int]]) -> int:
    """The n_gpu_layers to give llama.cpp for ``requested`` (a count, ``GPU_LAYERS_ALL``
    or ``GPU_LAYERS_AUTO``). ``shape()`` returns (n_layer, KV bytes per layer) and is
    called only for ``auto`` on a machine with a GPU. Without a GPU every request
    resolves to 0. A count above the slice's layers offloads all of it and its head
    (llama.cpp's rule)."""
    if requested == 0 or not gpu_devices():
        return 0
    if requested != GPU_LAYERS_AUTO:
        return requested
    n_layer, kv_bytes_per_layer = shape()
    return auto_layers(file_bytes=file_bytes, n_layer=n_layer, kv_bytes_per_layer=kv_bytes_per_layer,
                       free_vram=sum(d.free_bytes for d in gpu_devices()))


def backend_env_defaults() -> None:
    """Set the per-backend environment (only keys the user has not set): call before the
    first model loads, since ggml reads these once."""
    for env in BACKEND_ENV.values():
        for key, value in env.items():
            os.environ.setdefault(key, value)
