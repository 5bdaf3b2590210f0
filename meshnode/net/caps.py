"""Capability summaries as plain dicts (carried in Hello and the mDNS record) and back.

Dict form (JSON-safe, stable): ``{"free_ram": int, "free_vram": int, "backend": str,
"cores": int, "models": [{"name", "sha256", "layers", "size"}, ...]}``. Unknown keys
are ignored on read, so later versions can add fields.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from meshnode.state import Capabilities, HeldModel


def to_dict(caps: Capabilities) -> dict[str, Any]:
    return {
        "free_ram": int(caps.free_ram_bytes),
        "free_vram": int(caps.free_vram_bytes),
        "backend": caps.backend,
        "cores": int(caps.cores),
        "speed": round(float(caps.speed), 2),
        "models": [
            {"name": m.name, "sha256": m.sha256, "layers": m.n_layers, "size": m.size_bytes}
            for m in caps.models
        ],
    }


def from_dict(d: dict[str, Any] | None) -> Capabilities | None:
    if not isinstance(d, dict):
        return None
    try:
        models = tuple(
            HeldModel(str(m["name"]), str(m["sha256"]), int(m["layers"]), int(m.get("size", 0)))
            for m in d.get("models", ())
        )
        return Capabilities(
            free_ram_bytes=int(d.get("free_ram", 0)),
            free_vram_bytes=int(d.get("free_vram", 0)),
            backend=str(d.get("backend", "cpu")),
            cores=int(d.get("cores", 1)),
            models=models,
            speed=float(d.get("speed", 0.0)),
        )
    except (KeyError, TypeError, ValueError):
        return None


def local_capabilities(models: tuple[HeldModel, ...] = ()) -> Capabilities:
    """This machine's summary now (free RAM rounded to 64 MiB so the record is stable)."""
    return Capabilities(
        free_ram_bytes=_free_ram() // (64 << 20) * (64 << 20),
        free_vram_bytes=0,
        backend="cpu",
        cores=os.cpu_count() or 1,
        models=models,
        speed=measured_speed(),
    )


@functools.cache
def measured_speed() -> float:
    """GFLOP/s of a float32 matmul on this machine, measured once per process (~0.1 s).

    The planner weighs layers by it: a relative figure is all it needs, and a matmul
    tracks what a CPU decode step costs far better than a core count does.
    """
    import time

    import numpy as np

    a = np.random.default_rng(0).standard_normal((384, 384), dtype=np.float32)
    b = a.T.copy()
    a @ b  # warm-up (BLAS threads, caches)
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < 0.1:
        a @ b
        n += 1
    return 2 * 384**3 * n / elapsed / 1e9


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
