"""EngineWorker: where a step runs (pure scheduling logic; a fake engine records threads)."""

from __future__ import annotations

import asyncio
import threading
import time

from meshnode.engine.worker import EngineWorker


class _Engine:
    def __init__(self, threads: int = 1) -> None:
        self.calls: list[tuple[str, str]] = []   # (what, thread name)
        self.threads = threads
        self.copies_queued = False

    def threads_for(self, rows: int) -> int:
        return self.threads

    def work(self, what: str, seconds: float = 0.0) -> str:
        time.sleep(seconds)
        self.calls.append((what, threading.current_thread().name))
        return what

    def close(self) -> None: ...


def _steps(inline_max_s: float, rows: int, seconds: float, n: int = 3, threads: int = 1):
    """``n`` steps of ``rows`` rows that take ``seconds`` each: (thread of each call, the
    loop's thread, how many ran inline)."""
    async def go():
        eng = _Engine(threads)
        w = EngineWorker(eng, "t", inline_max_s=inline_max_s)
        for i in range(n):
            assert await w.step(rows, eng.work, f"s{i}", seconds) == f"s{i}"
        await w.close()
        return [t for _, t in eng.calls], threading.current_thread().name, w.inline_steps

    return asyncio.run(go())


def test_a_short_step_runs_on_the_loop_once_measured():
    threads, loop_thread, inline = _steps(0.05, rows=1, seconds=0.0)
    assert threads[0] != loop_thread          # unmeasured: on the thread (and measured there)
    assert threads[1:] == [loop_thread] * 2
    assert inline == 2


def test_a_slow_step_stays_off_the_loop():
    threads, loop_thread, inline = _steps(0.005, rows=64, seconds=0.02)
    assert all(t != loop_thread for t in threads) and inline == 0


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

    assert asyncio.run(go()) == ["warm", "rollback", "step"]


def test_a_multithreaded_step_never_runs_on_the_loop():
    # llama.cpp would open a second OpenMP team on the loop's thread (engine/worker.py)
    threads, loop_thread, inline = _steps(0.05, rows=1, seconds=0.0, threads=2)
    assert all(t != loop_thread for t in threads) and inline == 0


def test_every_engine_of_the_process_computes_on_one_thread():
    async def go():
        a, b = _Engine(2), _Engine(2)
        wa, wb = EngineWorker(a, "a"), EngineWorker(b, "b")
        await asyncio.gather(*(w.step(r, e.work, "x") for r in (1, 8) for w, e in ((wa, a), (wb, b))))
        await asyncio.gather(wa.call(a.work, "y"), wb.call(b.work, "y"))
        return {t for _, t in a.calls + b.calls}

    threads = asyncio.run(go())
    assert len(threads) == 1 and threads != {threading.main_thread().name}


def test_a_short_step_that_turns_long_on_the_loop_is_said_and_goes_to_the_thread(monkeypatch, caplog):
    """A step size known to be short runs inline; when one of them holds the loop past
    INLINE_WARN_S (peers judge a node dead after 1.5 s of silence) the worker warns and
    the next step of that size runs on the compute thread."""
    import logging

    from meshnode.engine import worker as worker_mod

    monkeypatch.setattr(worker_mod, "INLINE_WARN_S", 0.05)

    async def go():
        eng = _Engine()
        w = EngineWorker(eng, "stage", inline_max_s=0.02)
        for what, seconds in (("measure", 0.0), ("short", 0.0), ("long", 0.08), ("after", 0.0)):
            await w.step(1, eng.work, what, seconds)
        await w.close()
        return dict(eng.calls), threading.current_thread().name

    with caplog.at_level(logging.WARNING, logger="meshnode.engine.worker"):
        where, loop_thread = asyncio.run(go())
    assert where["short"] == loop_thread and where["long"] == loop_thread
    assert where["after"] != loop_thread
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("stage: a 1-row step held the event loop")


def test_the_step_after_a_session_copy_runs_on_the_thread():
    """llama.cpp copies KV across streams, and then reserves a new worst-case graph, in
    the decode after the copy: a short step size still goes to the thread then."""
    async def go():
        eng = _Engine()
        w = EngineWorker(eng, "t", inline_max_s=0.05)
        await w.step(1, eng.work, "measure")
        await w.step(1, eng.work, "inline")
        eng.copies_queued = True
        await w.step(1, eng.work, "after the copy")
        eng.copies_queued = False
        await w.step(1, eng.work, "inline again")
        await w.close()
        return dict(eng.calls), threading.current_thread().name

    where, loop_thread = asyncio.run(go())
    assert where["inline"] == loop_thread and where["inline again"] == loop_thread
    assert where["after the copy"] != loop_thread
