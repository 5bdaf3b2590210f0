"""Capability summaries as plain dicts (carried in Hello and the mDNS record) and back.

Dict form (JSON-safe, stable): ``{"free_ram": int, "free_vram": int, "backend": str,
"gpu_pad": int, "stage_threads": [now, most], "cores": int, "speed": float, "fetch": int, "models": [{"name", "sha256", "layers", "size",
"arch", "shared"}, ...]}`` (``fetch``: bytes/s of the node's latest pulls, 0 if none)
(``shared``: members may pull the model and any layer package of it). Unknown keys
are ignored on read, so later versions can add fields.

The network only carries capabilities as data; measuring this machine's is the mesh's
business (:mod:`meshnode.mesh.local_caps`).
"""

from __future__ import annotations

from typing import Any

from meshnode.limits import MAX_STAGE_THREADS
from meshnode.state import Capabilities, HeldModel


def to_dict(caps: Capabilities) -> dict[str, Any]:
    return {
        "free_ram": int(caps.free_ram_bytes),
        "free_vram": int(caps.free_vram_bytes),
        "backend": caps.backend,
        "gpu_pad": int(caps.gpu_pad_rows),
        "stage_threads": [int(caps.stage_threads[0]), int(caps.stage_threads[1])],
        "cores": int(caps.cores),
        "speed": round(float(caps.speed), 2),
        "fetch": round(float(caps.fetch_bytes_per_s)),
        "models": [
            {"name": m.name, "sha256": m.sha256, "layers": m.n_layers, "size": m.size_bytes,
             "arch": m.architecture, "shared": bool(m.shared)}
            for m in caps.models
        ],
    }


MAX_RATE = 1e12   # bytes/s a peer may claim (beyond any link): more is read as none


def _rate(v: Any) -> float:
    """A peer's measured rate, or 0 (not measured) when it is not a sane number."""
    r = float(v)
    return r if 0.0 <= r <= MAX_RATE else 0.0


def _threads(v: Any) -> tuple[int, int]:
    """A peer's (threads now, most) of its served stage, or (0, 0) when it is not a sane pair."""
    if (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            and 0 <= v[0] <= v[1] <= MAX_STAGE_THREADS):
        return int(v[0]), int(v[1])
    return 0, 0


def from_dict(d: dict[str, Any] | None) -> Capabilities | None:
    if not isinstance(d, dict):
        return None
    try:
        models = tuple(
            HeldModel(str(m["name"]), str(m["sha256"]), int(m["layers"]), int(m.get("size", 0)),
                      str(m.get("arch", ""))[:64], m.get("shared") is True)
            for m in d.get("models", ())
        )
        return Capabilities(
            free_ram_bytes=int(d.get("free_ram", 0)),
            free_vram_bytes=int(d.get("free_vram", 0)),
            backend=str(d.get("backend", "cpu")),
            cores=int(d.get("cores", 1)),
            models=models,
            speed=float(d.get("speed", 0.0)),
            fetch_bytes_per_s=_rate(d.get("fetch", 0)),
            gpu_pad_rows=int(d.get("gpu_pad", 0)),
            stage_threads=_threads(d.get("stage_threads")),
        )
    except (KeyError, TypeError, ValueError):
        return None
