"""This machine's capabilities, as the mesh advertises them: free RAM, usable cores and
a measured speed figure the planner weighs stages by.

The network layer carries capabilities as plain data (:mod:`meshnode.net.caps`); probing
the host is done here, by the mesh, which decides what to advertise.
"""

from __future__ import annotations

import functools
import os

from meshnode.limits import gpu_pad_rows
from meshnode.state import Capabilities, HeldModel


_offload = True


def set_offload(enabled: bool) -> None:
    """Whether this node offloads layers to its GPU (``--gpu-layers`` other than 0): a
    node that does not advertises the CPU backend and no VRAM, so the planner does not
    count on a GPU it will not use."""
    global _offload
    _offload = enabled


MEMORY_GRAIN = 64 << 20   # advertised memory is rounded down to this, so the record is stable


def advertised(n_bytes: int) -> int:
    """``n_bytes`` as a node advertises memory: rounded down to MEMORY_GRAIN."""
    return n_bytes // MEMORY_GRAIN * MEMORY_GRAIN


def local_capabilities(models: tuple[HeldModel, ...] = ()) -> Capabilities:
    """This machine's summary now (free RAM and VRAM rounded down to 64 MiB so the record
    is stable)."""
    backend, vram = gpu_summary() if _offload else ("cpu", 0)
    return Capabilities(
        free_ram_bytes=advertised(_free_ram()),
        free_vram_bytes=advertised(vram),
        backend=backend,
        cores=usable_cores(),
        models=models,
        speed=measured_speed(),
        gpu_pad_rows=gpu_pad_rows(),
    )


def gpu_summary() -> tuple[str, int]:
    """(backend, free VRAM bytes) as llama.cpp's device list gives them: ("cpu", 0) on a
    CPU-only build."""
    try:
        from meshnode.engine.offload import backend_summary
        return backend_summary()
    except (ImportError, OSError):   # no usable llama.cpp here: nothing to offload to
        return "cpu", 0


def usable_cores() -> int:
    """CPUs this process may run on (``meshnode serve --cpus`` narrows them): what the
    node advertises and what its speed figure scales by. The engine counts its default
    threads the same way (``engine.stage.default_threads``)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


SPEED_TRIALS = 7          # best of: a trial that shared its core is thrown away
SPEED_TRIAL_S = 0.015


@functools.cache
def measured_speed() -> float:
    """This machine's decode speed as the planner weighs it: single-core GFLOP/s of a
    small float32 matmul times the core count, measured once per process (~0.1 s).

    A relative figure is all the planner needs, but it must not depend on what else the
    machine is doing at start-up: nodes start next to a loading model, another node or
    a benchmark. A matmul big enough for BLAS to use every core collapses when one core
    is busy (its threads wait on each other): on a 2-core VM a 384 x 384
    matmul measured 60-84 quiet and 5-25 next to one busy process, and the planner gave
    one node 1 layer of 30. A 64 x 64 matmul stays on one thread, and the best of several
    short trials skips the ones that shared their core (38-60 busy against 59-63 quiet).
    """
    import time

    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 64), dtype=np.float32)
    b = rng.standard_normal((64, 64), dtype=np.float32)
    a @ b  # warm-up
    best = 0.0
    for _ in range(SPEED_TRIALS):
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < SPEED_TRIAL_S:
            a @ b
            n += 1
        best = max(best, n / elapsed)
    return 2 * 64**3 * best / 1e9 * usable_cores()


def _free_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
