"""Atomic file writes and hashing: a reader never sees a half-written file."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 20
TEMP_SUFFIX = ".part"   # temp files are ``.<name>.<random>.part`` beside their destination


def mkstemp_beside(path: Path) -> tuple[int, str]:
    """``tempfile.mkstemp`` beside ``path`` (same filesystem, so ``os.replace`` is atomic),
    named so that :func:`remove_temps_of` and :func:`remove_stale_temps` find it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)


@contextlib.contextmanager
def temp_beside(path: Path) -> Iterator[Path]:
    """A fresh temp file beside ``path`` (same filesystem, so ``os.replace`` is atomic),
    with ordinary permissions; removed on exit unless the caller renamed it away."""
    fd, name = mkstemp_beside(path)
    os.close(fd)
    tmp = Path(name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; these are ordinary files
    try:
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def atomic_write(path: Path, mode: str = "wb") -> Iterator[BinaryIO]:
    """Write to a temp file beside ``path`` and rename it into place on success.

    On any exception the temp file is removed and ``path`` is untouched.
    """
    fd, tmp = mkstemp_beside(path)
    try:
        with os.fdopen(fd, mode) as f:
            yield f  # type: ignore[misc]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def remove_temps_of(path: Path) -> None:
    """Delete the temp files a killed writer of ``path`` left (``atomic_write`` cleans up
    after an exception, not after SIGKILL). Only for a path with one writer at a time,
    which the caller is: another's temp file would be taken from under it."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*{TEMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            tmp.unlink()


def remove_stale_temps(root: Path, older_than_s: float) -> tuple[int, int]:
    """Delete the temp files (``.<name>.<random>.part``, what :func:`atomic_write` and
    :func:`temp_beside` write) under ``root`` untouched for ``older_than_s``: a writer
    killed mid-write (SIGKILL, a power cut) leaves its temp file, and a model's can be
    gigabytes nobody sees. A live writer keeps touching its file, so the age spares it.
    Returns (files removed, bytes freed)."""
    removed = freed = 0
    cutoff = time.time() - older_than_s
    for tmp in root.rglob(f".*{TEMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            st = tmp.lstat()
            if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                tmp.unlink()
                removed += 1
                freed += st.st_size
    return removed, freed


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable: without it a power cut after
    ``os.replace`` can bring back the old name (or none), whatever was fsynced."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return   # a platform without directory handles (Windows): the rename is what we have
    try:
        os.fsync(fd)
    except OSError:
        pass     # some filesystems refuse fsync on a directory; the data itself is synced
    finally:
        os.close(fd)


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    """Hex sha256 of a file; ``progress(n)`` is called with each chunk's size."""
    return sha256_files([path], progress)


def sha256_files(paths: list[Path], progress: Callable[[int], None] | None = None) -> str:
    """Hex sha256 of the files one after another (of their concatenation)."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                if progress:
                    progress(len(chunk))
    return h.hexdigest()
