"""Run the engines' blocking calls off the event loop, all on one thread per process.

llama_decode blocks for milliseconds to seconds; on the event loop a long call would
stall QUIC, HTTP and the TUI, so calls run on a worker thread, which also serialises
access to each llama context (it is not thread-safe).

**One compute thread for every engine of the process** (:func:`compute_pool`: the stages
this node serves, its own stage 0, the draft model). llama.cpp's CPU backend, as built
by llama-cpp-python on Linux, runs a multi-threaded graph as an OpenMP parallel region,
and libgomp keeps one team of threads per thread that opens a region. Once the threads
of all the teams outnumber the CPUs, libgomp throttles its spin-wait (to 100 spins) and
every barrier of the graph, several per layer, becomes a futex sleep and a wake-up. A
node that ran decode steps from two threads (the loop and a worker) decoded SmolLM2 at
32 tok/s with ~45,000 context switches a second on the 2-core VM; from one thread, 85-92
tok/s. Sharing the thread costs nothing real: engines of one process compete for the
same cores anyway.

A handoff to that thread and back is not free, though: on a 2-core VM the loop -> worker
-> loop round trip around a 7 ms call costs ~0.43 ms, because both threads sleep and
each wake-up of an idle (virtual) CPU is slow. A split decode step pays it on every
stage. So :meth:`EngineWorker.step` (decode steps and verify windows: a hot path) runs
the call *on the calling thread* when llama.cpp computes it on one CPU thread (no OpenMP
team is formed, so nothing above applies), the same row count last took at most
``inline_max_s`` (default 20 ms: a loop pause nobody notices), no thread job of the
engine is queued or running (its calls stay in order) and no KV copy across streams
waits for this call (a session copy or move: llama.cpp then copies the streams and
reserves a new worst-case graph first, 0.1 s and more with the KV on a GPU). Anything
else goes to the compute thread and is measured there, so a big model's steps never
block the loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from .errors import EngineError
from .stage import EngineConfig, Segment, StageEngine

T = TypeVar("T")
log = logging.getLogger(__name__)

INLINE_MAX_S = 0.020     # longest engine call worth running on the event loop
# An inline step this long is worth a warning: peers judge a node dead after 1.5 s
# without a byte from it (docs/mesh.md, "Failure detection"), and a step that was short
# before can turn long (a GPU engine moving KV between streams did: docs/engine.md).
INLINE_WARN_S = 0.25
_EWMA = 0.3

_compute: ThreadPoolExecutor | None = None
_compute_lock = threading.Lock()


def compute_pool() -> ThreadPoolExecutor:
    """The process's one llama.cpp compute thread (module docstring). Never shut down:
    it lives as long as the process and exits with it."""
    global _compute
    with _compute_lock:
        if _compute is None:
            _compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama")
        return _compute


async def run_compute(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on the compute thread (for llama.cpp work outside an EngineWorker)."""
    return await asyncio.get_running_loop().run_in_executor(compute_pool(), functools.partial(fn, *args))


class EngineWorker:
    """Owns a :class:`StageEngine`; runs its calls on the compute thread (module docstring)."""

    def __init__(self, engine: StageEngine, name: str = "engine", *,
                 inline_max_s: float = INLINE_MAX_S) -> None:
        self.engine = engine
        self.name = name
        self.inline_max_s = inline_max_s
        self._queued = 0                        # thread jobs submitted, not yet awaited back
        self._step_s: dict[int, float] = {}    # rows -> EWMA seconds of a step of that size
        self.inline_steps = 0                   # telemetry: steps run on the caller's thread
        self.released = False                   # handed to another owner: every call refused
        self.shelf = None                       # the EngineShelf that loaded it: close() parks it there
        self.held_bytes = 0                     # its memory estimate, for the shelf
        self.held_vram = 0                      # the device memory its load took, for the shelf
        self._closing = False

    @classmethod
    async def load(cls, config: EngineConfig, name: str = "engine", **kwargs) -> "EngineWorker":
        return cls(await run_compute(StageEngine, config), name, **kwargs)

    def handover(self, name: str) -> "EngineWorker":
        """A new worker (named ``name``) for this engine, with its step timings; this one
        refuses every call from now on. An engine changes owner this way (parked and
        taken back: :mod:`meshnode.engine.shelf`) so that a late call of its old owner,
        a task that still holds this worker, can never compute on the new owner's KV."""
        self._check_owned()
        other = EngineWorker(self.engine, name, inline_max_s=self.inline_max_s)
        other._step_s = dict(self._step_s)
        other.held_vram = self.held_vram
        self.released = True
        return other

    def _check_owned(self) -> None:
        if self.released:
            raise EngineError(f"{self.name}: this engine was handed to another owner")

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the compute thread (in submission order)."""
        self._check_owned()
        self._queued += 1
        try:
            return await run_compute(fn, *args)
        finally:
            self._queued -= 1

    async def step(self, rows: int, fn: Callable[..., T], *args: object) -> T:
        """Run a step of ``rows`` rows: inline if single-threaded and known to be short,
        else on the compute thread."""
        if self.runs_inline(rows):
            return self.run_inline(rows, fn, *args)
        result, seconds = await self.call(_timed, fn, args)
        self._measured(rows, seconds)
        return result

    def runs_inline(self, rows: int) -> bool:
        """Whether :meth:`step` would run a step of ``rows`` rows on the calling thread."""
        est = self._step_s.get(rows)
        return (est is not None and est <= self.inline_max_s and self._queued == 0 and not self.released
                and self.engine.threads_for(rows) == 1 and not self.engine.copies_queued)

    def run_inline(self, rows: int, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the calling thread, measured (check :meth:`runs_inline` first)."""
        self._check_owned()
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.inline_steps += 1
            seconds, before = time.perf_counter() - t0, self._step_s.get(rows, 0.0)
            self._measured(rows, seconds)
            if seconds > INLINE_WARN_S:
                log.warning("%s: a %d-row step held the event loop %.0f ms (such steps took %.1f ms); "
                            "steps of that size run on the compute thread until they are short again",
                            self.name, rows, 1e3 * seconds, 1e3 * before)

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
        """Done with the engine: park it on the shelf it came from (:mod:`.shelf`), or
        close it. A no-op once the engine went to another owner."""
        if self.released or self._closing:
            return
        self._closing = True
        if self.shelf is not None:
            await self.shelf.park(self)
        else:
            await self.close_engine()

    async def close_engine(self) -> None:
        """Close the engine, whoever loaded it (its memory is freed)."""
        if not self.released:
            await self.call(self.engine.close)


def _timed(fn: Callable[..., T], args: tuple) -> tuple[T, float]:
    """``fn(*args)`` and its duration, measured on the thread that ran it."""
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0
