"""Responses kept for ``previous_response_id`` (OpenAI's Responses API), bounded.

A Responses client may send only its new turn and name the answer it follows
(``previous_response_id``): the server then answers as if the earlier turns came first.
This node keeps, per answered response whose body did not say ``store: false``, the
conversation that answer ends (its input messages, those of the responses it followed,
and its own output as an assistant message) with the response object for
``GET /v1/responses/{id}``. Instructions are not part of it (OpenAI's rule: each request
gives its own).

The store is bounded by count and by size (the conversations' JSON), least recently
used out: a node forgets, so a client that must not lose a conversation sends it whole.
It lives in memory; a *journal* (:class:`Journal`, by default
:class:`~meshnode.serve.response_disk.ResponseDisk`) is told every change and mirrors
them on disk, and :meth:`ResponseStore.restore` takes them back when the node starts.
Response ids are random (128 bits) and the store belongs to the node that answered,
which is the model's coordinator (a member forwards the request there). Pure: no I/O
(the journal's is its own), one event loop.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from meshnode.limits import MAX_STORED_RESPONSE_BYTES, MAX_STORED_RESPONSES


@dataclass(frozen=True)
class StoredResponse:
    messages: tuple[dict[str, Any], ...]   # chat messages of the conversation it ends, no instructions
    response: dict[str, Any]               # the response object as answered
    size: int                              # bytes of both as JSON (what the bound counts)


class Journal(Protocol):
    """Where the store's changes go besides memory (each call returns at once)."""

    def put(self, response_id: str, messages_json: str, response_json: str) -> None: ...

    def delete(self, response_id: str) -> None: ...

    def touch(self, response_id: str) -> None: ...

    def load(self, max_entries: int, max_bytes: int) -> list[tuple[str, list[dict[str, Any]], dict[str, Any]]]: ...


class ResponseStore:
    """Kept responses by id, least recently used first. See the module docstring."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_RESPONSE_BYTES,
                 journal: Journal | None = None) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.journal = journal
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def restore(self, entries: list[tuple[str, list[dict[str, Any]], dict[str, Any]]]) -> int:
        """Take back ``entries`` (the journal's ``load``, least recently used first: a
        restarted node) without writing them back; returns how many are kept."""
        journal, self.journal = self.journal, None
        try:
            for response_id, messages, response in entries:
                self.put(response_id, messages, response)
        finally:
            self.journal = journal
        return len(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> bool:
        """Keep ``response`` and the conversation it ends; False when it alone is larger
        than the whole store (then nothing is kept)."""
        m, r = json.dumps(messages), json.dumps(response)
        size = len(m) + len(r)
        if size > self.max_bytes or self.max_entries <= 0:
            return False
        self._forget(response_id)
        while self._entries and (len(self._entries) >= self.max_entries or self._bytes + size > self.max_bytes):
            gone, old = self._entries.popitem(last=False)
            self._bytes -= old.size
            if self.journal is not None:
                self.journal.delete(gone)
        self._entries[response_id] = StoredResponse(tuple(messages), response, size)
        self._bytes += size
        if self.journal is not None:
            self.journal.put(response_id, m, r)
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        hit = self._entries.get(response_id)
        if hit is not None:
            self._entries.move_to_end(response_id)
            if self.journal is not None:
                self.journal.touch(response_id)
        return hit

    def delete(self, response_id: str) -> bool:
        if not self._forget(response_id):
            return False
        if self.journal is not None:
            self.journal.delete(response_id)
        return True

    def _forget(self, response_id: str) -> bool:
        old = self._entries.pop(response_id, None)
        if old is None:
            return False
        self._bytes -= old.size
        return True


__all__ = ["Journal", "ResponseStore", "StoredResponse"]
