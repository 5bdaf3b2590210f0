"""Run an engine's blocking calls on one dedicated thread, awaitable from asyncio.

llama_decode blocks for milliseconds to seconds; on the event loop it would stall QUIC,
HTTP and the TUI. One thread per engine also serialises access to its llama context,
which is not thread-safe.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from .stage import EngineSpec, Segment, StageEngine

T = TypeVar("T")


class EngineWorker:
    """Owns a :class:`StageEngine` and a single worker thread."""

    def __init__(self, engine: StageEngine, name: str = "engine") -> None:
        self.engine = engine
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    @classmethod
    async def load(cls, spec: EngineSpec, name: str = "engine") -> "EngineWorker":
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        engine = await asyncio.get_running_loop().run_in_executor(pool, StageEngine, spec)
        worker = cls.__new__(cls)
        worker.engine, worker._pool = engine, pool
        return worker

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    async def forward(self, segs: Sequence[Segment], rewind: bool = False) -> list[np.ndarray]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, functools.partial(self.engine.forward, segs, rewind=rewind))

    async def rollback(self, session: int, pos: int) -> None:
        await self.call(self.engine.rollback, session, pos)

    async def drop(self, session: int) -> None:
        await self.call(self.engine.drop, session)

    async def close(self) -> None:
        await self.call(self.engine.close)
        self._pool.shutdown(wait=False)
