"""Debug telemetry: where the event loop's thread is when the loop stalls.

A node computes short engine steps on its event loop (engine/worker.py) and judges a
peer dead after 1.5 s without a byte from it (docs/mesh.md, "Failure detection"), so a
loop held for long is both a latency and a liveness problem. Python's asyncio debug mode
names the callback that ran long, afterwards; this says where inside it the time went.

Off unless ``$MESHNODE_STALL_MS`` names a threshold in milliseconds (10..60000) when the
node starts. Then a loop callback refreshes a timestamp every quarter of it, and a daemon
thread logs (WARNING, logger ``meshnode.stallwatch``) the loop thread's Python stack
when that timestamp is older than the threshold: once per distinct stack in one stall,
and the stall's length when the loop runs again, with how much of it Python's garbage
collector held the interpreter (a ``gc.callbacks`` hook times every collection while the
watch is on: a full collection stops every thread, and its stack shows only the
allocation that set it off). Costless when off: nothing starts.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import threading
import time
import traceback
from collections import deque

__all__ = ["ENV", "start"]

ENV = "MESHNODE_STALL_MS"
STACK_FRAMES = 12
GC_KEPT = 256   # recent collections remembered to account a stall's time to
log = logging.getLogger(__name__)


def start(loop: asyncio.AbstractEventLoop) -> bool:
    """Watch ``loop`` (run on this thread) when ``$MESHNODE_STALL_MS`` asks for it;
    True when the watch started."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return False
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not 10 <= ms <= 60_000:
        log.warning("%s=%r is not a number of milliseconds in 10..60000: no stall watch", ENV, raw)
        return False
    _StallWatch(loop, ms / 1000.0).start()
    log.info("stall watch: the loop thread's stack is logged when the loop stalls over %.0f ms", ms)
    return True


class _StallWatch:
    def __init__(self, loop: asyncio.AbstractEventLoop, limit_s: float) -> None:
        self.loop = loop
        self.limit_s = limit_s
        self.beat = time.monotonic()          # the loop's last tick (written by the loop only)
        self.loop_thread = threading.get_ident()
        self.collections: deque[tuple[float, float, int]] = deque(maxlen=GC_KEPT)   # (start, end, gen)
        self._gc_start = 0.0

    def start(self) -> None:
        self.loop.call_soon(self._tick)
        gc.callbacks.append(self._on_gc)
        threading.Thread(target=self._watch, name="stall-watch", daemon=True).start()

    def _on_gc(self, phase: str, info: dict) -> None:
        # called by the collecting thread with the interpreter held: no other thread runs
        if phase == "start":
            self._gc_start = time.monotonic()
        else:
            self.collections.append((self._gc_start, time.monotonic(), info.get("generation", -1)))

    def gc_within(self, begin: float, end: float) -> tuple[float, int]:
        """Seconds of garbage collection between ``begin`` and ``end``, and the oldest
        generation collected then (-1: none)."""
        spent, oldest = 0.0, -1
        for start, stop, gen in list(self.collections):
            overlap = min(stop, end) - max(start, begin)
            if overlap > 0:
                spent += overlap
                oldest = max(oldest, gen)
        return spent, oldest

    def _tick(self) -> None:
        self.beat = time.monotonic()
        self.loop.call_later(self.limit_s / 4, self._tick)

    def _watch(self) -> None:
        stalled_at: float | None = None   # the beat the current stall began after
        seen: set[str] = set()
        while not self.loop.is_closed():
            time.sleep(self.limit_s / 4)
            beat = self.beat
            if stalled_at is not None and beat != stalled_at:
                spent, gen = self.gc_within(stalled_at, beat)
                log.warning("event loop stall over: %.0f ms without a tick%s", 1e3 * (beat - stalled_at),
                            f", {1e3 * spent:.0f} ms of it in garbage collection (generation {gen})"
                            if gen >= 0 else ", no garbage collection in it")
                stalled_at, seen = None, set()
            lag = time.monotonic() - beat
            if lag <= self.limit_s:
                continue
            frame = sys._current_frames().get(self.loop_thread)
            # the innermost frames: what the loop's callback is doing (not the loop's own)
            stack = "".join(traceback.format_stack(frame)[-STACK_FRAMES:]) if frame is not None else "(no frame)\n"
            if stalled_at is None:
                stalled_at = beat
            if stack not in seen:
                seen.add(stack)
                log.warning("event loop stalled for %.0f ms so far; its thread is at:\n%s", 1e3 * lag, stack.rstrip())
        gc.callbacks.remove(self._on_gc)   # the loop is gone: nothing left to account for
