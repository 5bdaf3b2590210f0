"""Engines kept for a moment after their stage ends, for the next load of the same stage.

Why: a failover re-plans the model with a new term, and every stage of the old plan is
stopped, its engine freed, before the new plan loads. When a spare takes the lost
stage's layer range (:func:`meshnode.mesh.replan.substitute`), stage 0 and the stages
that survived load exactly what they just freed: the same slice with the same
parameters. That load is the model's weights read again (mapped, from the page cache)
and, on a GPU, uploaded again: ~0.06 s for SmolLM2's slices on a 2-core VM, seconds for
an 8B model, while the model serves nothing.

What: every engine a node loads comes from its :class:`EngineShelf`, and closing such a
worker parks it there instead: its sessions dropped (:meth:`StageEngine.reset`), kept
under its :class:`EngineConfig` for ``keep_s`` seconds. A load with an equal config takes
it back at once (a new :class:`EngineWorker`: the old owner's worker refuses every call
from then on); a load of anything else first closes every parked engine, so parking never
adds to the memory a node needs at its peak. So the parked engines' memory
(:meth:`held_bytes`, and on a GPU :meth:`held_vram`, the device memory the engine's load
took) counts as free wherever a node weighs its memory: what a Load may ask of a stage
server, a coordinator's own capacity, the free RAM and VRAM a node advertises to its
peers. That memory is freed before anything else loads, or reused as it is.

Results do not change: a stage's results never depend on the sessions it served before
(each session's KV is a stream of its own: ``EngineConfig``), which is also why a
long-lived stage may serve one request after another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from .stage import EngineConfig
from .worker import EngineWorker

__all__ = ["KEEP_S", "EngineShelf"]

log = logging.getLogger(__name__)

KEEP_S = 30.0   # a re-plan loads within ~1 s; a spare fetching a slice takes longer


@dataclass(slots=True)
class _Parked:
    worker: EngineWorker
    held_bytes: int
    held_vram: int
    timer: asyncio.TimerHandle | None


def _free_vram() -> int:
    """Free device memory now, summed over the GPUs (0 without one)."""
    from .offload import gpu_devices

    return sum(d.free_bytes for d in gpu_devices())


class EngineShelf:
    """One node's parked engines (see the module docstring). ``keep_s``: how long an
    engine waits to be taken back before it is closed (0: never park)."""

    def __init__(self, keep_s: float = KEEP_S) -> None:
        self.keep_s = keep_s
        self._parked: dict[EngineConfig, _Parked] = {}
        self._closing: set[asyncio.Task] = set()
        self._parking: set[asyncio.Future] = set()   # parks under way (a load waits for them)
        self._closed = False
        self.reused = 0          # telemetry: loads answered from the shelf

    def held_bytes(self) -> int:
        """The memory the parked engines hold, as estimated when each was loaded."""
        return sum(p.held_bytes for p in self._parked.values())

    def held_vram(self) -> int:
        """The device memory the parked engines hold, as their loads took it."""
        return sum(p.held_vram for p in self._parked.values())

    def holds(self, config: EngineConfig) -> bool:
        return config in self._parked

    async def load(self, config: EngineConfig, name: str, *, held_bytes: int = 0) -> EngineWorker:
        """A worker for ``config``: the parked engine of an equal config, else a fresh load
        (after closing every parked engine). ``held_bytes``: the memory estimate of this
        engine, for :meth:`held_bytes` while it is parked later."""
        while self._parking:   # an engine on its way here may be the one asked for
            await asyncio.gather(*self._parking)
        parked = self._parked.pop(config, None)
        if parked is not None:
            if parked.timer is not None:
                parked.timer.cancel()
            self.reused += 1
            log.info("%s: reusing the loaded engine of %s", name, config.path.name)
            worker = parked.worker.handover(name)
        else:
            await self.clear()
            # what the load takes of the GPUs (weights, KV, buffers), measured: the shelf
            # gives it back to the node's free VRAM while the engine is parked
            before = _free_vram() if config.gpu_layers else 0
            worker = await EngineWorker.load(config, name)
            if config.gpu_layers:
                worker.held_vram = max(0, before - _free_vram())
        worker.shelf, worker.held_bytes = self, held_bytes
        return worker

    async def park(self, worker: EngineWorker) -> None:
        """Keep ``worker``'s engine, reset, for the next load of its config (closing an
        engine parked under that config already); close it when the shelf is closed or
        keeps nothing, or the reset fails."""
        if self._closed or self.keep_s <= 0:
            await worker.close_engine()
            return
        done = asyncio.get_running_loop().create_future()
        self._parking.add(done)
        try:
            await self._park(worker)
        finally:
            self._parking.discard(done)
            done.set_result(None)

    async def _park(self, worker: EngineWorker) -> None:
        try:
            await worker.call(worker.engine.reset)
        except Exception as exc:  # noqa: BLE001 - an engine that cannot be reset is not kept
            log.warning("%s: not kept for reuse (%s)", worker.name, exc)
            await worker.close_engine()
            return
        if self._closed:   # shut down meanwhile
            await worker.close_engine()
            return
        config = worker.engine.config
        old = self._parked.pop(config, None)
        if old is not None:
            self._close_soon(old)
        parked = _Parked(worker.handover(worker.name), worker.held_bytes, worker.held_vram, None)
        parked.timer = asyncio.get_running_loop().call_later(self.keep_s, self._expire, config, parked)
        self._parked[config] = parked

    def _expire(self, config: EngineConfig, parked: _Parked) -> None:
        if self._parked.get(config) is parked:
            del self._parked[config]
            log.info("%s: parked engine of %s closed after %g s unused",
                     parked.worker.name, config.path.name, self.keep_s)
            self._close_soon(parked)

    def _close_soon(self, parked: _Parked) -> None:
        task = asyncio.get_running_loop().create_task(parked.worker.close_engine())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def clear(self) -> None:
        """Close every parked engine (and wait for engines being closed)."""
        parked, self._parked = list(self._parked.values()), {}
        for p in parked:
            if p.timer is not None:
                p.timer.cancel()
            self._close_soon(p)
        while self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def close(self) -> None:
        """Node shutdown: close every parked engine; engines closed later close at once."""
        self._closed = True
        with contextlib.suppress(Exception):
            await self.clear()
