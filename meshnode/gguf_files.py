"""Which files make up a GGUF model: one, or the parts of a split model named as
llama.cpp names them (``llama_split_path``: ``<prefix>-00001-of-0000N.gguf`` ...).

By name alone, nothing is read: below both ``engine`` (which sizes a GPU offload by the
model's bytes) and ``models`` (whose ``gguf_info.open_gguf`` opens and checks the parts,
docs/models.md "Split models").
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = [
    "MAX_SPLIT_PARTS", "model_files", "model_size", "split_name", "split_part", "split_part_name",
    "split_part_path", "split_prefix",
]

# llama.cpp's name for part i (1-based) of n: llama_split_path, "%s-%05d-of-%05d.gguf"
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAX_SPLIT_PARTS = 999   # llama-gguf-split's own limit is far above any real model's parts


def split_name(name: str) -> tuple[str, int, int] | None:
    """(prefix, part number from 1, part count) when ``name`` is named as a part of a
    split model, else None."""
    m = _SPLIT_NAME.match(name)
    if m is None:
        return None
    no, count = int(m["no"]), int(m["count"])
    return (m["prefix"], no, count) if 1 <= no <= count <= MAX_SPLIT_PARTS and count > 1 else None


def split_part(path: Path) -> tuple[int, int] | None:
    """(part number from 1, part count) when ``path`` is named as a part of a split
    model, else None (by name alone)."""
    split = split_name(path.name)
    return None if split is None else split[1:]


def split_part_name(prefix: str, no: int, count: int) -> str:
    """The file name of part ``no`` (from 1) of ``count`` of the split model ``prefix``."""
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def split_prefix(name: str) -> str | None:
    """What comes before ``-0000K-of-0000N.gguf`` in a part's name (None: not a part)."""
    split = split_name(name)
    return None if split is None else split[0]


def split_part_path(part: Path, no: int, count: int) -> Path:
    """Part ``no`` (from 1) of the split model that ``part`` (named as a part) belongs to."""
    prefix = split_prefix(part.name)
    assert prefix is not None
    return part.with_name(split_part_name(prefix, no, count))


def model_files(path: Path) -> list[Path]:
    """The files of the model at ``path``: every part when it is named as the first part
    of a split model, else ``path`` alone. By name only: ``models.gguf_info.open_gguf``
    checks them."""
    part = split_part(path)
    if part is None or part[0] != 1:
        return [path]
    return [split_part_path(path, i, part[1]) for i in range(1, part[1] + 1)]


def model_size(path: Path) -> int:
    """Bytes of the model at ``path``, every part of a split model (0 for a part missing)."""
    total = 0
    for f in model_files(path):
        try:
            total += f.stat().st_size
        except OSError:
            pass
    return total
