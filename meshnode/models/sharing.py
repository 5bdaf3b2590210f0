"""Which of this node's models are kept from members: ``state/unshared.json``, a list of
sha256 (``meshnode models unshare``). Everything else in the store is shared while
sharing is on (``[models] share``, ``--no-share``)."""

from __future__ import annotations

import contextlib
import json

from meshnode.fsutil import atomic_write
from meshnode.paths import NodePaths

__all__ = ["set_shared", "unshared"]

MAX_ENTRIES = 4096


def _path(paths: NodePaths):
    return paths.state / "unshared.json"


def unshared(paths: NodePaths) -> set[str]:
    """sha256 of the models kept from members (an unreadable file keeps nothing back)."""
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(_path(paths).read_text())
        if isinstance(data, list):
            return {s for s in data[:MAX_ENTRIES] if isinstance(s, str)}
    return set()


def set_shared(paths: NodePaths, sha256: str, shared: bool) -> None:
    keep = unshared(paths)
    (keep.discard if shared else keep.add)(sha256)
    paths.state.mkdir(parents=True, exist_ok=True)
    with atomic_write(_path(paths), "w") as f:
        json.dump(sorted(keep), f)  # type: ignore[arg-type]
