"""Server-sent events framing and the keep-alive pump for streamed generations.

Theory of operation: OpenAI streams are SSE (WHATWG HTML "Server-sent events"): each
chunk is ``data: <json>\\n\\n`` and the stream ends with ``data: [DONE]\\n\\n``. A line
starting with ``:`` is a comment that clients ignore; we send ``: keep-alive`` when the
engine has produced nothing for a while (long prefill, a slow peer) so proxies and
editors don't time the connection out.

:class:`EventPump` waits for the engine's next event without ever cancelling it on a
timeout: the pending ``__anext__`` runs as its own task, and a timeout only reports a
keep-alive tick. Cancelling an async generator's ``__anext__`` would kill the generator,
so cancellation happens only in :meth:`EventPump.aclose`, on purpose.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar

__all__ = ["DONE", "KEEP_ALIVE", "EventPump", "KeepAliveTick", "sse_data"]

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"

T = TypeVar("T")


def sse_data(payload: dict[str, Any] | str) -> bytes:
    """One SSE event carrying ``payload`` (a dict is JSON-encoded, a str sent as is)."""
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    # JSON never holds a raw newline, so one data line is always enough.
    return b"data: " + text.encode() + b"\n\n"


def sse_event(name: str, payload: dict[str, Any]) -> bytes:
    """One SSE event of type ``name`` (an ``event:`` line) carrying ``payload`` as JSON."""
    return b"event: " + name.encode() + b"\n" + sse_data(payload)


class KeepAliveTick:
    """Returned by :meth:`EventPump.next` when no event came within the interval."""

    __slots__ = ()


_TICK = KeepAliveTick()


async def _anext(source: AsyncIterator[T]) -> T:
    return await source.__anext__()


class EventPump(Generic[T]):
    """Pull events from an async iterator with keep-alive ticks; close it exactly once.

    ``await next()`` returns the next item, or a :class:`KeepAliveTick` after
    ``interval`` seconds without one (the pending read keeps running), and raises
    ``StopAsyncIteration`` at the end. The owner must call :meth:`aclose` (shielded from
    cancellation if it runs in a cancelled scope).
    """

    def __init__(self, source: AsyncIterator[T], interval: float) -> None:
        self._source = source
        self._interval = interval
        self._pending: asyncio.Task[T] | None = None
        self._closed = False

    async def next(self) -> T | KeepAliveTick:
        if self._pending is None:
            self._pending = asyncio.create_task(_anext(self._source))
        done, _ = await asyncio.wait({self._pending}, timeout=self._interval)
        if not done:
            return _TICK
        task, self._pending = self._pending, None
        return task.result()  # raises StopAsyncIteration at the end, or the engine's error

    async def aclose(self) -> None:
        """Cancel a pending read and ``aclose()`` the source so the engine frees its session."""
        if self._closed:
            return
        self._closed = True
        if self._pending is not None:
            self._pending.cancel()
            await asyncio.gather(self._pending, return_exceptions=True)
            self._pending = None
        aclose = getattr(self._source, "aclose", None)
        if aclose is not None:
            await aclose()
