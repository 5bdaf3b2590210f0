"""The stall watch (meshnode/stallwatch.py): debug telemetry that logs where a stalled
event loop's thread is. Off unless $MESHNODE_STALL_MS is set."""

from __future__ import annotations

import asyncio
import logging
import time

from meshnode import stallwatch


def _hold_the_loop_in_a_named_place(seconds: float) -> None:
    time.sleep(seconds)


def _run(seconds: float) -> bool:
    async def main() -> bool:
        started = stallwatch.start(asyncio.get_running_loop())
        await asyncio.sleep(0.05)
        _hold_the_loop_in_a_named_place(seconds)
        await asyncio.sleep(0.15)   # the watch sees the loop tick again
        return started
    return asyncio.run(main())


def test_a_stall_is_logged_with_where_the_loop_thread_was_and_how_long_it_lasted(monkeypatch, caplog):
    monkeypatch.setenv(stallwatch.ENV, "40")
    with caplog.at_level(logging.INFO, logger="meshnode.stallwatch"):
        assert _run(1.0)   # (long beside the 10 ms polls: a loaded machine may be slow to run the watch)
    said = [r.getMessage() for r in caplog.records if r.name == "meshnode.stallwatch"]
    stalls = [m for m in said if m.startswith("event loop stalled")]
    assert stalls and all("_hold_the_loop_in_a_named_place" in m for m in stalls)
    assert len(stalls) == 1   # one stack, said once however long the stall
    over = [m for m in said if m.startswith("event loop stall over")]
    assert len(over) == 1 and 950 <= int(over[0].split(": ")[1].split(" ")[0]) <= 4000


def test_off_by_default_and_a_bad_value_says_so(monkeypatch, caplog):
    monkeypatch.delenv(stallwatch.ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="meshnode.stallwatch"):
        assert not _run(0.1)
    assert not caplog.records
    for bad in ("fast", "5", "1e9"):
        monkeypatch.setenv(stallwatch.ENV, bad)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="meshnode.stallwatch"):
            assert not _run(0.0)
        assert any("no stall watch" in r.getMessage() for r in caplog.records)


def test_a_stall_inside_a_garbage_collection_says_how_much_of_it_the_collector_took(monkeypatch, caplog):
    # A full collection stops every thread, and the loop thread's stack shows only the
    # allocation that set it off: the watch times collections to say so. A slow
    # collection is made by a gc callback that sleeps (the watch's own runs first).
    import gc

    def slow_collection(phase: str, info: dict) -> None:
        if phase == "start":
            time.sleep(0.3)

    async def main() -> None:
        assert stallwatch.start(asyncio.get_running_loop())
        gc.callbacks.append(slow_collection)
        try:
            await asyncio.sleep(0.05)
            gc.collect()
            await asyncio.sleep(0.15)
        finally:
            gc.callbacks.remove(slow_collection)

    monkeypatch.setenv(stallwatch.ENV, "40")
    with caplog.at_level(logging.INFO, logger="meshnode.stallwatch"):
        asyncio.run(main())
    over = [r.getMessage() for r in caplog.records if r.getMessage().startswith("event loop stall over")]
    assert len(over) == 1
    spent = int(over[0].split(", ")[1].split(" ms")[0])
    assert 250 <= spent <= 2000 and "garbage collection (generation 2)" in over[0]
    # the loop is closed: the watch's collector hook goes with it
    deadline = time.monotonic() + 2
    while any(getattr(cb, "__name__", "") == "_on_gc" for cb in gc.callbacks) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(getattr(cb, "__name__", "") == "_on_gc" for cb in gc.callbacks)
