"""EngineWorker: where a step runs (pure scheduling logic; a fake engine records threads)."""

from __future__ import annotations

import asyncio
import threading
import time

from meshnode.engine.worker import EngineWorker


class _Engine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []   # (what, thread name)

    def work(self, what: str, seconds: float = 0.0) -> str:
        time.sleep(seconds)
        self.calls.append((what, threading.current_thread().name))
        return what

    def close(self) -> None: ...


def _run(coro):
    return asyncio.run(coro)


def test_a_short_step_runs_on_the_loop_once_measured():
    async def go():
        eng = _Engine()
        w = EngineWorker(eng, "t", inline_max_s=0.05)
        loop_thread = threading.current_thread().name
        for i in range(3):
            assert await w.step(1, eng.work, f"s{i}") == f"s{i}"
        await w.close()
        return eng.calls, loop_thread, w.inline_steps

    calls, loop_thread, inline = _run(go())
    assert calls[0][1] != loop_thread          # unmeasured: on the thread (and measured there)
    assert [t for _, t in calls[1:]] == [loop_thread] * 2
    assert inline == 2


def test_a_slow_step_stays_off_the_loop():
    async def go():
        eng = _Engine()
        w = EngineWorker(eng, "t", inline_max_s=0.005)
        loop_thread = threading.current_thread().name
        for _ in range(3):
            await w.step(64, eng.work, "slow", 0.02)
        await w.close()
        return eng.calls, loop_thread, w.inline_steps

    calls, loop_thread, inline = _run(go())
    assert all(t != loop_thread for _, t in calls) and inline == 0


def test_a_step_never_overtakes_a_queued_thread_job():
    async def go():
        eng = _Engine()
        w = EngineWorker(eng, "t", inline_max_s=0.05)
        await w.step(1, eng.work, "warm")           # now known to be short
        slow = asyncio.ensure_future(w.call(eng.work, "rollback", 0.05))
        await asyncio.sleep(0)                       # the rollback is queued/running
        step = asyncio.ensure_future(w.step(1, eng.work, "step"))
        await asyncio.gather(slow, step)
        await w.close()
        return [what for what, _ in eng.calls]

    assert _run(go()) == ["warm", "rollback", "step"]
