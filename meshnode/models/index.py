"""The model index: which GGUFs a node holds under ``NodePaths.models``, and their sha256.

Theory of operation. Layout: one folder per model, ``<models>/<name>/<file>.gguf``, with
a record ``<file>.gguf.meta.json`` beside it holding the file's sha256, size, mtime and a
few metadata fields. The sha256 is computed once (multi-GB files are not rehashed on
every start): the record is trusted while the file's size and mtime_ns are unchanged.
A GGUF dropped straight into ``<models>/`` also counts (its name is the file stem).
Records of GGUFs outside the store (a path given on the command line) live under
``<cache>/hashes/``, so a user's folder is never written to.

Records are written atomically (temp file + rename). A file is validated as a GGUF
before its record vouches for it; a bad one raises ModelFileError.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshnode.fsutil import atomic_write, sha256_file, sha256_files
from meshnode.models.errors import ModelFileError
from meshnode.gguf_files import model_files, split_part, split_prefix
from meshnode.models.gguf_info import read_model_info
from meshnode.models.progress import ProgressFn
from meshnode.models.transfer import PART_SUFFIX
from meshnode.paths import NodePaths

RECORD_SUFFIX = ".meta.json"
# In a model's folder while a fetch by URL is unfinished (its URL): the folder holds no
# model yet (meshnode.models.url_fetch)
FETCH_NOTE = ".fetch-url"

__all__ = [
    "FETCH_NOTE",
    "RECORD_SUFFIX",
    "STORE_NAME",
    "ModelRef",
    "file_record",
    "hash_with_progress",
    "list_models",
    "model_ref_for_path",
    "partial_pulls",
    "record_path",
    "store_entries",
    "store_name",
    "vouch_for",
    "write_record",
]


@dataclass(frozen=True, slots=True)
class ModelRef:
    """A GGUF a node can load: its name, path, content sha256 and shape facts."""

    name: str
    path: Path
    sha256: str
    n_layers: int
    architecture: str


def _stamp(gguf: Path) -> tuple[int, int]:
    """(bytes, newest mtime_ns) of the model's files (every part of a split model): what
    a record is trusted by. Raises OSError when one is missing."""
    stats = [f.stat() for f in model_files(gguf)]
    return sum(st.st_size for st in stats), max(st.st_mtime_ns for st in stats)


def file_record(gguf: Path, record: Path, name: str, *, progress: ProgressFn | None) -> ModelRef:
    """ModelRef for ``gguf``, hashing it only when ``record`` is missing or stale."""
    gguf.stat()   # (the model's own file missing: OSError, as before any part is read)
    try:
        size, mtime_ns = _stamp(gguf)
    except OSError:
        size, mtime_ns = -1, -1   # a part missing: read_model_info says which
    data: Any = None
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(record.read_text())
    if (
        isinstance(data, dict)
        and data.get("size") == size
        and data.get("mtime_ns") == mtime_ns
        and isinstance(data.get("sha256"), str)
        and isinstance(data.get("n_layers"), int)
        and isinstance(data.get("architecture"), str)
    ):
        return ModelRef(name, gguf, data["sha256"], data["n_layers"], data["architecture"])
    info = read_model_info(gguf)  # validates the file (every part) before we vouch for it
    sha = hash_with_progress(gguf, info.size, progress)
    write_record(record, gguf, sha, info.n_layers, info.architecture, {})
    return ModelRef(name, gguf, sha, info.n_layers, info.architecture)


def write_record(
    record: Path, gguf: Path, sha: str, n_layers: int, architecture: str, extra: dict[str, Any]
) -> None:
    size, mtime_ns = _stamp(gguf)
    body = {
        "file": str(gguf.name),
        "sha256": sha,
        "size": size,
        "mtime_ns": mtime_ns,
        "n_layers": n_layers,
        "architecture": architecture,
        **extra,
    }
    with atomic_write(record, "w") as f:
        json.dump(body, f, indent=2)  # type: ignore[arg-type]


def vouch_for(gguf: Path, sha: str, name: str, extra: dict[str, Any] | None = None) -> ModelRef:
    """Record ``gguf``, whose sha256 the caller has just verified (a fetch or a pull), without
    hashing it again: read as a GGUF first, so a bad file raises ModelFileError and is removed
    rather than vouched for. Writing the record before anyone lists the store matters: a
    listing that found no record would hash the whole file itself, and two processes (the
    node advertising, a CLI listing) would each do it at once."""
    try:
        info = read_model_info(gguf)
    except ModelFileError:
        gguf.unlink(missing_ok=True)
        raise
    write_record(record_path(gguf), gguf, sha, info.n_layers, info.architecture, extra or {})
    return ModelRef(name, gguf, sha, info.n_layers, info.architecture)


def hash_with_progress(path: Path, total: int, progress: ProgressFn | None) -> str:
    """The model's sha256: of its file, or of a split model's parts one after another
    (what their concatenation would hash to: one id however the model was split)."""
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress("hash", done, total)

    files = model_files(path)
    return sha256_file(files[0], tick) if len(files) == 1 else sha256_files(files, tick)


def record_path(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + RECORD_SUFFIX)


def _outside_record_path(gguf: Path, paths: NodePaths) -> Path:
    key = hashlib.sha1(str(gguf.resolve()).encode()).hexdigest()
    return paths.cache / "hashes" / f"{key}.json"


def partial_pulls(paths: NodePaths) -> list[tuple[str, Path, int]]:
    """(name, the model file it would become, bytes it takes on disk) of each pull of a whole
    model that stopped before the end (``meshnode.models.transfer.PartFile``): kept for the
    pull to resume, never listed as a model."""
    out: list[tuple[str, Path, int]] = []
    if paths.models.is_dir():
        for part in sorted(paths.models.glob(f"*.gguf{PART_SUFFIX}")):
            with contextlib.suppress(OSError):
                st = part.stat()
                if part.is_file() and not part.name.startswith("."):
                    # the file has the model's full size from the start; blocks are what it holds
                    held = st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
                    dest = part.with_name(part.name[:-len(PART_SUFFIX)])
                    out.append((dest.stem, dest, held))
    return out


def store_entries(paths: NodePaths) -> list[tuple[str, Path]]:
    """(name, gguf path) of every model in the store, sorted by name."""
    root = paths.models
    out: list[tuple[str, Path]] = []
    if not root.is_dir():
        return out
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_file() and entry.suffix == ".gguf" and not _later_part(entry):
            out.append((store_name(entry), entry))
        elif entry.is_dir() and not (entry / FETCH_NOTE).exists():
            ggufs = _model_ggufs(entry)
            if len(ggufs) == 1:
                out.append((entry.name, ggufs[0]))
            else:
                out.extend((f"{entry.name}/{store_name(g)}", g) for g in ggufs)
    return out


def _later_part(path: Path) -> bool:
    """``path`` is named as part 2 or later of a split model (listed by its first part)."""
    part = split_part(path)
    return part is not None and part[0] > 1


# A name the store takes for a model folder (`--name` of `models quantize` / `fetch`)
STORE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")


def store_name(path: Path) -> str:
    """The name a GGUF in the store goes by: its stem, a split model's without the
    ``-00001-of-0000N`` of its first part."""
    return split_prefix(path.name) or path.stem


def _model_ggufs(folder: Path) -> list[Path]:
    """The models of ``folder``: its .gguf files, a split model by its first part."""
    return sorted(p for p in folder.glob("*.gguf") if not p.name.startswith(".") and not _later_part(p))


def list_models(paths: NodePaths, *, progress: ProgressFn | None = None) -> list[ModelRef]:
    """Every model in the store. A GGUF without a valid record is validated and hashed
    once (``progress("hash", ...)``); files that are not valid GGUF raise ModelFileError."""
    refs = []
    for name, gguf in store_entries(paths):
        refs.append(file_record(gguf, record_path(gguf), name, progress=progress))
    return refs


def model_ref_for_path(path: Path | str, paths: NodePaths, *, progress: ProgressFn | None = None) -> ModelRef:
    """ModelRef for a GGUF anywhere on disk (validated; hashed once, record in the cache)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFileError(f"model file not found: {p}")
    if p.is_dir():
        ggufs = _model_ggufs(p)
        if len(ggufs) != 1:
            raise ModelFileError(f"{p} is a folder with {len(ggufs)} .gguf files; name one of them")
        p = ggufs[0]
    p = p.resolve()
    try:
        p.relative_to(paths.models.resolve())
        record = record_path(p)
    except ValueError:
        record = _outside_record_path(p, paths)
    return file_record(p, record, store_name(p), progress=progress)
