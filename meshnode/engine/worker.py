"""Run an engine's blocking calls off the event loop, unless they are known to be short.

llama_decode blocks for milliseconds to seconds; on the event loop a long call would
stall QUIC, HTTP and the TUI, so calls run on one dedicated thread, which also
serialises access to the llama context (it is not thread-safe).

A handoff to that thread and back is not free, though: on a 2-core VM
the loop -> worker -> loop round trip around a 7 ms call costs ~0.43 ms, because both
threads sleep and each wake-up of an idle (virtual) CPU is slow. A split decode step
pays it on every stage, which was a sixth of a SmolLM2 step. So :meth:`EngineWorker.step`
(decode steps and verify windows: a hot path) runs the call *on the calling thread*
when the same row count last took at most ``inline_max_s`` (default 20 ms: a loop
pause nobody notices) and no thread job is queued or running (calls stay in order).
Anything not yet measured, or slower, goes to the thread as before and is measured
there, so a big model's steps never block the loop.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from .stage import EngineConfig, Segment, StageEngine

T = TypeVar("T")

INLINE_MAX_S = 0.020     # longest engine call worth running on the event loop
_EWMA = 0.3


class EngineWorker:
    """Owns a :class:`StageEngine` and a single worker thread (see the module docstring)."""

    def __init__(self, engine: StageEngine, name: str = "engine", *,
                 inline_max_s: float = INLINE_MAX_S, pool: ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        self._pool = pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.inline_max_s = inline_max_s
        self._queued = 0                        # thread jobs submitted, not yet awaited back
        self._step_s: dict[int, float] = {}    # rows -> EWMA seconds of a step of that size
        self.inline_steps = 0                   # telemetry: steps run on the caller's thread

    @classmethod
    async def load(cls, config: EngineConfig, name: str = "engine", **kwargs) -> "EngineWorker":
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        try:
            engine = await asyncio.get_running_loop().run_in_executor(pool, StageEngine, config)
        except BaseException:
            pool.shutdown(wait=False)
            raise
        return cls(engine, name, pool=pool, **kwargs)

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the worker thread (in submission order)."""
        loop = asyncio.get_running_loop()
        self._queued += 1
        try:
            return await loop.run_in_executor(self._pool, functools.partial(fn, *args))
        finally:
            self._queued -= 1

    async def step(self, rows: int, fn: Callable[..., T], *args: object) -> T:
        """Run a step of ``rows`` rows: inline if known to be short, else on the thread."""
        est = self._step_s.get(rows)
        if est is not None and est <= self.inline_max_s and self._queued == 0:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.inline_steps += 1
                self._measured(rows, time.perf_counter() - t0)
        result, seconds = await self.call(_timed, fn, args)
        self._measured(rows, seconds)
        return result

    def _measured(self, rows: int, seconds: float) -> None:
        old = self._step_s.get(rows)
        self._step_s[rows] = seconds if old is None else old + _EWMA * (seconds - old)

    async def forward(self, segs: Sequence[Segment], rewind: bool = False) -> list[np.ndarray]:
        rows = sum(int((s.tokens if s.tokens is not None else s.hidden).shape[0]) for s in segs)
        return await self.step(rows, functools.partial(self.engine.forward, segs, rewind=rewind))

    async def rollback(self, session: int, pos: int) -> None:
        await self.call(self.engine.rollback, session, pos)

    async def copy(self, src: int, dst: int, n_pos: int) -> None:
        await self.call(self.engine.copy, src, dst, n_pos)

    async def drop(self, session: int) -> None:
        await self.call(self.engine.drop, session)

    async def close(self) -> None:
        await self.call(self.engine.close)
        self._pool.shutdown(wait=False)


def _timed(fn: Callable[..., T], args: tuple) -> tuple[T, float]:
    """``fn(*args)`` and its duration, measured on the thread that ran it."""
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0
