"""Kept Responses on disk, so that a node that restarts still continues them.

Theory of operation: :class:`~meshnode.serve.response_store.ResponseStore` is the truth
while the node runs (memory, bounded, least recently used out); this journal mirrors it
into one SQLite file under the node's data folder (``responses.sqlite3``, owner-only),
and the next start reads it back. The store tells the journal every change (kept,
forgotten, used), and the journal writes it on one thread of its own, in order, so the
event loop never waits for the disk. A write that fails is logged once and the node
goes on in memory: a lost journal only means a restarted node forgets, which is what
it did before there was a journal.

The file is the node's own, but a file is input like any other: reading it back
bounds what it may allocate (the store's count and bytes), skips a row whose JSON is
not what the store writes, and treats a file that SQLite cannot read as absent (moved
aside as ``responses.sqlite3.bad``, one warning). Conversations are user data, so the
file is created readable by its owner only.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE_NAME = "responses.sqlite3"
_SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    used INTEGER NOT NULL,
    size INTEGER NOT NULL,
    messages TEXT NOT NULL,
    response TEXT NOT NULL
)"""


class ResponseDisk:
    """The journal of one node's kept responses (see the module docstring).

    :meth:`put`, :meth:`delete` and :meth:`touch` return at once; :meth:`flush` waits
    for what was handed in so far (tests, shutdown)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="responses-disk")
        self._db: sqlite3.Connection | None = None
        self._failed = False
        self._fresh = False      # the file was set aside once already
        self._used = 0           # a counter, not a clock: the order rows were last used in
        self._lock = threading.Lock()

    @classmethod
    def open(cls, folder: Path) -> ResponseDisk:
        """The journal in ``folder`` (created if missing); reading happens in :meth:`load`."""
        return cls(Path(folder) / FILE_NAME)

    # ---- reading back (once, at start) ------------------------------------------------

    def load(self, max_entries: int, max_bytes: int) -> list[tuple[str, list[dict[str, Any]], dict[str, Any]]]:
        """The kept responses, least recently used first, at most ``max_entries`` of
        ``max_bytes`` in all (the most recent win); rows beyond those are deleted."""
        return self._pool.submit(self._load, max_entries, max_bytes).result()

    def _load(self, max_entries: int, max_bytes: int) -> list:
        db = self._connect()
        if db is None:
            return []
        out, total, keep = [], 0, set()
        try:
            # sizes first: a row is read only when it fits what is left of the budget
            listing = db.execute("SELECT id, used, length(messages) + length(response) FROM responses "
                                 "ORDER BY used DESC LIMIT ?", (max(0, max_entries),)).fetchall()
            for rid, used, size in listing:
                if not isinstance(size, int) or total + size > max_bytes:
                    continue
                row = db.execute("SELECT messages, response FROM responses WHERE id = ?", (rid,)).fetchone()
                entry = _entry(rid, *row) if row is not None else None
                if entry is None:
                    continue
                total += size
                out.append(entry)
                keep.add(rid)
                if isinstance(used, int):
                    self._used = max(self._used, used)
            stale = [r[0] for r in db.execute("SELECT id FROM responses").fetchall() if r[0] not in keep]
        except sqlite3.DatabaseError as e:
            self._set_aside(f"unreadable ({e})")
            return []
        if stale:
            self._write(lambda c: c.executemany("DELETE FROM responses WHERE id = ?", [(r,) for r in stale]))
        out.reverse()
        return out

    # ---- mirroring the store ----------------------------------------------------------

    def put(self, response_id: str, messages_json: str, response_json: str) -> None:
        """Keep one answer: its conversation's and its own JSON, as the store wrote them."""
        m, r = messages_json, response_json
        used = self._next_used()
        self._submit(lambda c: c.execute(
            "INSERT OR REPLACE INTO responses (id, used, size, messages, response) VALUES (?, ?, ?, ?, ?)",
            (response_id, used, len(m) + len(r), m, r)))

    def delete(self, response_id: str) -> None:
        self._submit(lambda c: c.execute("DELETE FROM responses WHERE id = ?", (response_id,)))

    def touch(self, response_id: str) -> None:
        used = self._next_used()
        self._submit(lambda c: c.execute("UPDATE responses SET used = ? WHERE id = ?", (used, response_id)))

    def flush(self) -> None:
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.submit(self._close).result()
        self._pool.shutdown(wait=True)

    # ---- on the journal's thread --------------------------------------------------------

    def _next_used(self) -> int:
        with self._lock:
            self._used += 1
            return self._used

    def _submit(self, change: Callable[[sqlite3.Connection], Any]) -> None:
        if self._failed:
            return
        try:
            self._pool.submit(self._write, change)
        except RuntimeError:   # closed: the node is stopping
            pass

    def _write(self, change: Callable[[sqlite3.Connection], Any]) -> None:
        db = self._connect()
        if db is None:
            return
        try:
            with db:
                change(db)
        except sqlite3.Error as e:
            self._fail(f"cannot write {self.path} ({e})")

    def _connect(self) -> sqlite3.Connection | None:
        if self._db is not None or self._failed:
            return self._db
        db = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self.path.exists():   # owner-only from the start: conversations are user data
                os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(_SCHEMA)
            db.execute("SELECT id, used, size, messages, response FROM responses LIMIT 0")
        except sqlite3.DatabaseError as e:
            if db is not None:
                db.close()
            if self._fresh:   # a new file that SQLite cannot use: nothing more to try
                self._fail(f"cannot open {self.path} ({e})")
                return None
            self._fresh = True
            self._set_aside(f"not a responses journal ({e})")
            return self._connect()
        except (OSError, sqlite3.Error) as e:
            if db is not None:
                db.close()
            self._fail(f"cannot open {self.path} ({e})")
            return None
        self._db = db
        return db

    def _set_aside(self, why: str) -> None:
        """Move an unreadable file aside (once) and start a new one."""
        if self._db is not None:
            self._db.close()
            self._db = None
        bad = self.path.with_name(self.path.name + ".bad")
        try:
            os.replace(self.path, bad)
            for suffix in ("-wal", "-shm"):
                Path(str(self.path) + suffix).unlink(missing_ok=True)
        except OSError as e:
            self._fail(f"{self.path}: {why}, and it cannot be moved aside ({e})")
            return
        log.warning("kept responses: %s: %s; moved to %s, starting afresh", self.path, why, bad.name)

    def _fail(self, why: str) -> None:
        if not self._failed:
            log.warning("kept responses stay in memory only: %s", why)
        self._failed = True

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def _entry(rid: Any, messages: Any, response: Any):
    """A row as the store keeps it, or None when it is not what :meth:`put` writes."""
    if not (isinstance(rid, str) and isinstance(messages, str) and isinstance(response, str)):
        return None
    try:
        m, r = json.loads(messages), json.loads(response)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(m, list) and all(isinstance(x, dict) for x in m) and isinstance(r, dict)):
        return None
    return rid, m, r
