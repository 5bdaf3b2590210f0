"""The model store: what a user names as a model, resolved to a GGUF a node can load.

Theory of operation. The store is three parts, each in its own module:

- :mod:`meshnode.models.index` -- what is on disk under ``NodePaths.models``: the
  GGUFs, their records and sha256s (:class:`ModelRef`, :func:`list_models`,
  :func:`model_ref_for_path`);
- :mod:`meshnode.models.catalog` -- the models meshnode knows how to fetch, and the
  default model (:data:`DEFAULT_MODEL`, :data:`KNOWN_MODELS`);
- :mod:`meshnode.models.fetch` -- getting a known model into the store (downloads,
  wheels, progress, verification: :func:`fetch_model`, :func:`fetch_default_model`).

This module puts them together for the callers (CLI, node, benchmarks):
:func:`resolve_model` turns what the user typed -- nothing, a path, a store name or a
known model's name -- into a :class:`ModelRef`, and the names above are importable
from here too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from meshnode.fsutil import remove_stale_temps

from meshnode.models.catalog import DEFAULT_MODEL, KNOWN_MODELS
from meshnode.models.errors import ModelFileError, ModelNotFoundError
from meshnode.models.fetch import fetch_default_model, fetch_model
from meshnode.models.index import (
    ModelRef,
    file_record,
    list_models,
    model_ref_for_path,
    record_path,
    store_entries,
)
from meshnode.models.progress import ProgressFn
from meshnode.models.url_fetch import fetch_url, is_model_url
from meshnode.paths import NodePaths

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "ModelRef",
    "fetch_default_model",
    "fetch_model",
    "list_models",
    "model_ref_for_path",
    "resolve_model",
    "sweep_stale_temps",
]

log = logging.getLogger(__name__)

# a temp file nobody has written for this long belongs to a writer that is gone
STALE_TEMP_S = 3600.0


def resolve_model(
    spec: str | None,
    paths: NodePaths,
    *,
    source_dir: Path | str | None = None,
    progress: ProgressFn | None = None,
    allow_url: bool = False,
) -> ModelRef:
    """Turn what the user typed into a ModelRef.

    - None / "" / "default": the default model, fetched on first use.
    - with ``allow_url`` (what the user typed on this machine, never a name from the
      network): an http(s) URL of a .gguf file or a Hugging Face name (``hf:...``), fetched
      into the store on first use (:mod:`meshnode.models.url_fetch`).
    - an existing path: that GGUF (or the only GGUF in that folder), validated.
    - a name: a model in the store (exact, then case-insensitive); a known model's name
      (``KNOWN_MODELS``) is fetched on first use.

    Raises ModelNotFoundError, ModelFileError, ModelFetchError / ChecksumError.
    """
    if spec is None or spec.strip() in ("", "default"):
        return fetch_default_model(paths, source_dir=source_dir, progress=progress)
    if allow_url and is_model_url(spec):
        return fetch_url(spec, paths, progress=progress)
    candidate = Path(spec).expanduser()
    if candidate.exists():
        return model_ref_for_path(candidate, paths, progress=progress)
    entries = store_entries(paths)
    for match in (lambda n: n == spec, lambda n: n.lower() == spec.lower()):
        found = [(n, g) for n, g in entries if match(n)]
        if len(found) == 1:
            name, gguf = found[0]
            return file_record(gguf, record_path(gguf), name, progress=progress)
    known = {k.lower(): v for k, v in KNOWN_MODELS.items()}
    if spec.lower() in known:
        return fetch_model(known[spec.lower()].name, paths, source_dir=source_dir, progress=progress)
    if spec.endswith(".gguf") or os.sep in spec or "/" in spec:
        raise ModelFileError(f"model file not found: {candidate}")
    available = ", ".join(sorted({n for n, _ in entries} | set(KNOWN_MODELS))) or "none"
    raise ModelNotFoundError(
        f"no model '{spec}': not a file, and not in the store at {paths.models} "
        f"(available: {available})"
    )


def sweep_stale_temps(paths: NodePaths) -> None:
    """Remove what killed writes left in the store and the layer packages
    (:func:`meshnode.fsutil.remove_stale_temps`); a node does it as it starts. A pull's
    ``<file>.part`` is not a temp file: it stays for the pull to resume."""
    removed = freed = 0
    for root in (paths.models, paths.slices):
        n, size = remove_stale_temps(root, STALE_TEMP_S)
        removed, freed = removed + n, freed + size
    if removed:
        log.info("removed %d temp file(s) of interrupted writes (%.1f MB) from %s", removed, freed / 1e6,
                 paths.data)
