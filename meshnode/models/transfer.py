"""Verified, resumable chunked transfers of a file: manifests, the chunk plan, the part file.

Theory of operation
-------------------
A holder describes a file it shares with a :class:`Manifest`: its size, its whole sha256,
a fixed chunk size (:data:`CHUNK_SIZE`) and the sha256 of every chunk. Computing one reads
the file once, so :func:`cached_manifest` keeps it under ``cache/manifests`` keyed by the
file's path, size and mtime (a changed file gets a new manifest).

A puller drives two pieces:

* :class:`ChunkPlan` (sans-IO): which chunks are missing, which source fetches which
  chunk next, and what happens to a chunk that failed its sha256: it is put back and
  offered to another source first; a source that sent :data:`MAX_BAD_CHUNKS` bad chunks
  is dropped. Thread-safe (one lock), because each source is served by its own thread.
* :class:`PartFile` (IO): chunks are verified (:func:`chunk_ok`) and written at their
  offsets into ``<dest>.part``; the indices of written chunks go to ``<dest>.part.json``
  after an ``fsync`` of the part file (at most every :data:`CHECKPOINT_S`), so a puller
  killed at any point resumes with every recorded chunk intact. The whole file's sha256
  is computed while the transfer runs by a thread of its own, which reads the written
  chunks back in file order (from the page cache) as the cursor reaches them: the
  connection threads never wait for it, and it overlaps with their decryption and
  per-chunk hashing. :meth:`PartFile.finish` renames the file to ``dest`` only when it
  matches: a partial or corrupt file is never visible under the model's name.

Free space is checked before the first byte (:func:`check_free_space`). Every size a
peer's manifest states is bounded by :meth:`Manifest.from_dict` before it is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshnode.errors import MeshnodeError
from meshnode.fsutil import atomic_write, remove_temps_of

log = logging.getLogger(__name__)

__all__ = [
    "CHUNK_SIZE", "PART_SUFFIX", "ChunkPlan", "Manifest", "PartFile", "TransferError", "build_manifest",
    "cached_manifest", "check_free_space", "chunk_ok", "part_paths", "remove_partial",
]

CHUNK_SIZE = 8 * 1024 * 1024
MIN_CHUNK_SIZE = 64 * 1024
MAX_CHUNK_SIZE = 64 * 1024 * 1024
MAX_FILE_SIZE = 1 << 40            # 1 TiB: far above any GGUF a LAN node would share
MAX_CHUNKS = MAX_FILE_SIZE // CHUNK_SIZE
MAX_BAD_CHUNKS = 3                 # a source that sent this many bad chunks is dropped
CHECKPOINT_S = 0.5                 # the part file's record is rewritten at most this often
FREE_SPACE_MARGIN = 64 * 1024 * 1024
_READ = 4 * 1024 * 1024
_HASH_READ = 1024 * 1024           # the whole-file hasher's reads: still in the CPU cache when hashed


class TransferError(MeshnodeError):
    """A transfer cannot go on (bad manifest, no source left, no space, hash mismatch)."""


def _hex64(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


@dataclass(frozen=True, slots=True)
class Manifest:
    size: int
    sha256: str
    chunk_size: int
    chunks: tuple[str, ...]

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    def span(self, index: int) -> tuple[int, int]:
        """(offset, length) of chunk ``index``."""
        off = index * self.chunk_size
        return off, min(self.chunk_size, self.size - off)

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256, "chunk_size": self.chunk_size,
                "chunks": list(self.chunks)}

    @classmethod
    def from_dict(cls, d: Any) -> "Manifest":
        """Validate a peer's manifest. Raises :class:`TransferError` naming the bad field."""
        if not isinstance(d, dict):
            raise TransferError("manifest is not an object")
        size, cs, chunks, sha = d.get("size"), d.get("chunk_size"), d.get("chunks"), d.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_FILE_SIZE:
            raise TransferError(f"manifest: bad size {size!r}")
        if not isinstance(cs, int) or isinstance(cs, bool) or not MIN_CHUNK_SIZE <= cs <= MAX_CHUNK_SIZE:
            raise TransferError(f"manifest: bad chunk_size {cs!r}")
        if not _hex64(sha):
            raise TransferError("manifest: bad sha256")
        n = -(-size // cs)
        if not isinstance(chunks, list) or len(chunks) != n or not all(_hex64(c) for c in chunks):
            raise TransferError(f"manifest: expected {n} chunk hashes")
        return cls(size, sha, cs, tuple(chunks))


def build_manifest(path: Path, chunk_size: int = CHUNK_SIZE,
                   progress: Callable[[int, int], None] | None = None) -> Manifest:
    """Read ``path`` once: the whole sha256 and each chunk's. Blocking."""
    whole = hashlib.sha256()
    chunks = []
    size = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk_size)
            if not data:
                break
            whole.update(data)
            chunks.append(hashlib.sha256(data).hexdigest())
            done += len(data)
            if progress is not None:
                progress(done, size)
    if done == 0:
        raise TransferError(f"{path} is empty")
    return Manifest(done, whole.hexdigest(), chunk_size, tuple(chunks))


def cached_manifest(path: Path, cache_dir: Path, chunk_size: int = CHUNK_SIZE) -> Manifest:
    """:func:`build_manifest`, computed once per (path, size, mtime). Blocking."""
    st = path.stat()
    key = hashlib.sha1(str(path.resolve()).encode()).hexdigest()
    rec_path = cache_dir / f"{key}.json"
    with contextlib.suppress(OSError, ValueError, TransferError):
        rec = json.loads(rec_path.read_text())
        if rec.get("size_on_disk") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns:
            m = Manifest.from_dict(rec.get("manifest"))
            if m.chunk_size == chunk_size:
                return m
    m = build_manifest(path, chunk_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with atomic_write(rec_path, "w") as f:
        json.dump({"path": str(path), "size_on_disk": st.st_size, "mtime_ns": st.st_mtime_ns,
                   "manifest": m.to_dict()}, f)  # type: ignore[arg-type]
    return m


def chunk_ok(manifest: Manifest, index: int, data: bytes | memoryview) -> bool:
    """True when ``data`` is exactly chunk ``index`` of ``manifest``."""
    return len(data) == manifest.span(index)[1] and hashlib.sha256(data).hexdigest() == manifest.chunks[index]


def check_free_space(directory: Path, needed: int) -> None:
    """Raise :class:`TransferError` when ``directory``'s file system lacks ``needed`` bytes
    (plus a margin)."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < needed + FREE_SPACE_MARGIN:
        raise TransferError(f"not enough free space in {directory}: {needed / 1e6:.0f} MB needed, "
                            f"{free / 1e6:.0f} MB free")


def _writeback_starter() -> Callable[[int, int, int], None]:
    """Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``: start writing a range to disk
    without waiting, so the fsyncs of the checkpoints and of :meth:`PartFile.finish` find
    little left to write (on a fast pull the last fsync was up to a sixth of its time).
    A no-op where the call is missing."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    except (OSError, AttributeError):
        return lambda fd, off, n: None

    def start(fd: int, off: int, n: int) -> None:
        fn(fd, off, n, 2)    # SYNC_FILE_RANGE_WRITE; a failure only leaves the work to the fsync

    return start


_start_writeback = _writeback_starter()


# ---- the plan (sans-IO) --------------------------------------------------------------------


@dataclass(slots=True)
class _Source:
    bad: int = 0
    dropped: bool = False
    reason: str = ""


@dataclass
class ChunkPlan:
    """Which chunk each source fetches next (module docstring). ``done``: chunks already
    held (a resumed transfer)."""

    n_chunks: int
    sources: Iterable[str]
    done: Iterable[int] = ()
    _missing: list[int] = field(init=False)
    _srcs: dict[str, _Source] = field(init=False)
    _tried: dict[int, set[str]] = field(init=False)
    _inflight: dict[int, str] = field(init=False)
    _done: set[int] = field(init=False)
    _lock: threading.Lock = field(init=False)

    def __post_init__(self) -> None:
        self._done = {i for i in self.done if 0 <= i < self.n_chunks}
        self._missing = [i for i in range(self.n_chunks) if i not in self._done]
        self._srcs = {s: _Source() for s in self.sources}
        self._tried = {}
        self._inflight = {}
        self._lock = threading.Lock()

    @property
    def complete(self) -> bool:
        return len(self._done) == self.n_chunks

    @property
    def done_count(self) -> int:
        return len(self._done)

    @property
    def busy(self) -> bool:
        """Chunks are missing or in flight (a worker with nothing to do now may get one back)."""
        with self._lock:
            return bool(self._missing or self._inflight)

    def alive(self) -> list[str]:
        return [s for s, st in self._srcs.items() if not st.dropped]

    def next_for(self, source: str) -> int | None:
        """The next chunk ``source`` should fetch, or None (nothing left for it)."""
        with self._lock:
            if self._srcs[source].dropped:
                return None
            alive = self.alive()
            for pos, i in enumerate(self._missing):
                # a chunk that failed from this source goes to another one while there is one
                tried = self._tried.get(i, ())
                if source in tried and any(s not in tried for s in alive):
                    continue
                del self._missing[pos]
                self._inflight[i] = source
                return i
            return None

    def chunk_done(self, index: int) -> None:
        with self._lock:
            self._inflight.pop(index, None)
            self._done.add(index)

    def chunk_bad(self, index: int, source: str, why: str = "bad chunk") -> None:
        """Chunk ``index`` from ``source`` failed its check: put it back."""
        with self._lock:
            self._inflight.pop(index, None)
            self._tried.setdefault(index, set()).add(source)
            self._missing.insert(0, index)
            st = self._srcs[source]
            st.bad += 1
            if st.bad >= MAX_BAD_CHUNKS:
                st.dropped, st.reason = True, f"{st.bad} bad chunks ({why})"

    def source_failed(self, source: str, reason: str, index: int | None = None) -> None:
        """``source`` cannot serve any more (connection lost, refused); its chunk goes back."""
        with self._lock:
            if index is not None and index not in self._done:
                self._inflight.pop(index, None)
                self._missing.insert(0, index)
            st = self._srcs[source]
            st.dropped, st.reason = True, reason

    def why_stuck(self) -> str:
        return "; ".join(f"{s}: {st.reason}" for s, st in self._srcs.items() if st.dropped) or "no source"


# ---- the part file (IO) ----------------------------------------------------------------------


PART_SUFFIX = ".part"


def part_paths(dest: Path) -> tuple[Path, Path]:
    """The part file of a pull to ``dest`` and its chunk record (module docstring)."""
    return dest.with_name(dest.name + PART_SUFFIX), dest.with_name(dest.name + PART_SUFFIX + ".json")


def remove_partial(dest: Path) -> None:
    """Delete what a stopped pull to ``dest`` left for a resume."""
    for path in part_paths(dest):
        path.unlink(missing_ok=True)


class PartFile:
    """``<dest>.part`` and its record ``<dest>.part.json`` (module docstring)."""

    def __init__(self, dest: Path, manifest: Manifest) -> None:
        self.dest = dest
        self.manifest = manifest
        self.part, self.record = part_paths(dest)
        self._lock = threading.Lock()
        self._ckpt_lock = threading.Lock()
        self._written: set[int] = set()
        self._recorded: set[int] = set()
        self._last = time.monotonic()
        # the whole file's sha256, in file order, by the hasher thread (started by the first
        # write or by finish); _cursor: the first chunk it has not hashed yet
        self._whole = hashlib.sha256()
        self._cursor = 0
        self._cond = threading.Condition(self._lock)
        self._hasher: threading.Thread | None = None
        self._hash_error: OSError | None = None
        self._closing = False
        remove_temps_of(self.record)   # a killed pull's half-written record
        self.done = self._resume()
        self._fd = os.open(self.part, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(self._fd, manifest.size)

    def _resume(self) -> set[int]:
        """Chunks a previous attempt at the same file recorded (nothing when the record is
        for another file or unreadable)."""
        try:
            rec = json.loads(self.record.read_text())
        except (OSError, ValueError):
            return set()
        if not isinstance(rec, dict) or rec.get("sha256") != self.manifest.sha256 or not self.part.exists():
            return set()
        done = {i for i in rec.get("chunks", []) if isinstance(i, int) and 0 <= i < self.manifest.n_chunks}
        self._recorded = set(done)
        self._written = set(done)
        return done

    @property
    def bytes_held(self) -> int:
        return sum(self.manifest.span(i)[1] for i in self._written)

    def write(self, index: int, data: bytes | memoryview) -> None:
        """Write verified chunk ``index`` at its offset (thread-safe)."""
        off, _ = self.manifest.span(index)
        view = memoryview(data)
        while view:
            n = os.pwrite(self._fd, view, off)
            view, off = view[n:], off + n
        with self._cond:
            self._written.add(index)
            if index == self._cursor:
                self._cond.notify()
        self._start_hasher()   # it checkpoints too: no connection thread waits for an fsync

    def _start_hasher(self) -> None:
        with self._lock:
            if self._hasher is not None or self._closing:
                return
            self._hasher = threading.Thread(target=self._hash_loop, name="part-hash", daemon=True)
        self._hasher.start()

    def _hash_loop(self) -> None:
        """Feed the whole sha256 with each written chunk in order, until the last one (or
        close); checkpoint at most every :data:`CHECKPOINT_S` meanwhile."""
        buf = bytearray(min(_HASH_READ, self.manifest.chunk_size))
        mv = memoryview(buf)
        n_chunks = self.manifest.n_chunks
        try:
            while True:
                with self._cond:
                    while (not self._closing and self._cursor < n_chunks and self._cursor not in self._written
                           and time.monotonic() - self._last < CHECKPOINT_S):
                        self._cond.wait(CHECKPOINT_S)
                    if self._closing or self._cursor >= n_chunks:
                        return
                    index = self._cursor if self._cursor in self._written else None
                if time.monotonic() - self._last >= CHECKPOINT_S:
                    try:
                        self.checkpoint()
                    except OSError as exc:   # the pull goes on; only a resume would start earlier
                        log.warning("cannot record the chunks of %s: %s", self.part, exc)
                if index is None:
                    continue
                off, n = self.manifest.span(index)
                end = off + n
                while off < end:
                    k = os.preadv(self._fd, [mv[:min(len(buf), end - off)]], off)
                    if k <= 0:
                        raise OSError(f"{self.part} is shorter than written")
                    self._whole.update(mv[:k])
                    off += k
                _start_writeback(self._fd, off - n, n)
                with self._cond:
                    self._cursor += 1
                    self._cond.notify_all()
        except OSError as exc:
            with self._cond:
                self._hash_error = exc
                self._cond.notify_all()

    def checkpoint(self) -> None:
        """fsync the part file, then record the chunks it held before the fsync. Other
        threads keep writing meanwhile (only one checkpoint runs at a time)."""
        if not self._ckpt_lock.acquire(blocking=False):
            return
        try:
            self._last = time.monotonic()
            with self._lock:
                chunks = set(self._written)
            if chunks == self._recorded:
                return
            os.fdatasync(self._fd)
            with atomic_write(self.record, "w") as f:
                json.dump({"sha256": self.manifest.sha256, "chunks": sorted(chunks)}, f)  # type: ignore[arg-type]
            self._recorded = chunks
        finally:
            self._ckpt_lock.release()

    def finish(self) -> Path:
        """Check the whole file's sha256 and rename it to ``dest``. On a mismatch the part
        file and record are deleted and :class:`TransferError` is raised."""
        n_chunks = self.manifest.n_chunks
        digest = None
        if self._fd >= 0 and len(self._written) == n_chunks:
            self._start_hasher()                  # a resumed pull may have written nothing
            with self._cond:
                while self._cursor < n_chunks and self._hash_error is None:
                    self._cond.wait()
                if self._cursor == n_chunks:
                    digest = self._whole.hexdigest()
        self.close()
        if digest is None:
            h = hashlib.sha256()
            with open(self.part, "rb") as f:
                while data := f.read(_READ):
                    h.update(data)
            digest = h.hexdigest()
        if digest != self.manifest.sha256:
            self.discard()
            raise TransferError(f"{self.dest.name}: the assembled file's sha256 does not match the manifest")
        os.replace(self.part, self.dest)
        self.record.unlink(missing_ok=True)
        return self.dest

    def close(self) -> None:
        """Keep what was written (a later attempt resumes from it)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            hasher = self._hasher
        if hasher is not None:
            hasher.join()
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                self.checkpoint()
            os.close(self._fd)
            self._fd = -1

    def discard(self) -> None:
        self.close()
        remove_partial(self.dest)
