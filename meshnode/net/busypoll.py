"""Busy polling: the event loop spins, instead of sleeping, while messages are due soon.

Theory of operation. On a split's token path every message wakes a process that went to
sleep in ``epoll_wait`` a millisecond or two earlier: the sending stage's next stage, then
the coordinator when the token comes back. Waking a sleeping process (and the idle CPU
under it) is a good part of what a hop costs: with busy polling the token path's hops
measured 79-104 us against 124-143 us on a two-H200 host, 55 against 112 us on the 2-core
VM (docs/mesh.md, "Busy polling"). Spinning on the socket instead of sleeping removes that
wake-up, at the price of a CPU core kept busy while the loop waits.

:class:`BusyPollSelector` is the loop's ordinary selector (epoll on Linux, kqueue on
macOS) that, for ``window_s`` after the last time something was ready, waits by polling
its own descriptor in a C loop without the GIL (``_spin.c``) before it falls back to the
ordinary sleeping wait. While tokens flow, every wait is a spin; a node that has had
nothing to read for ``window_s`` sleeps as before, so an idle node costs nothing.

It pays where a CPU can be spared: a node whose stages run on a GPU (the CPU mostly waits
anyway). On a CPU node whose llama.cpp threads use every core, the spinning loop takes a
core from them. So it is off unless ``--busy-poll`` or ``[node] busy_poll`` turns it on
(``cli/run.py``: ``loop_factory``); :func:`busy_poll_loop_factory` builds the loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import selectors
import time
from collections.abc import Callable
from pathlib import Path

from meshnode.native import load_c_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_spin.c")
# How long after the last message the loop keeps spinning: longer than a GPU split's step
# plus the wait for the next message (a few ms), so every wait of a flowing stream spins;
# short enough that a node with nothing to do is asleep again within a blink.
WINDOW_S = 0.05


def _spinner() -> Callable[[int, int], int] | None:
    lib = load_c_library(SOURCE, "busy polling")
    if lib is None:
        return None
    fn = lib.meshnode_spin_readable
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int64]
    return fn


class BusyPollSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The default selector, spinning for up to ``window_s`` after the last ready event
    (module docstring). ``spin(fd, ns)`` is the C poll loop."""

    def __init__(self, window_s: float, spin: Callable[[int, int], int]) -> None:
        super().__init__()
        self.window_s = window_s
        self._spin = spin
        self._hot_until = 0.0
        self.spins = 0          # telemetry: waits that a spin ended with something ready

    def select(self, timeout: float | None = None) -> list:
        if timeout is None or timeout > 0:
            left = self._hot_until - time.monotonic()
            if left > 0:
                spin_s = left if timeout is None else min(left, timeout)
                if self._spin(self.fileno(), int(spin_s * 1e9)) != 0:
                    timeout = 0
                    self.spins += 1
                elif timeout is not None:
                    timeout = max(0.0, timeout - spin_s)
        ready = super().select(timeout)
        if ready:
            self._hot_until = time.monotonic() + self.window_s
        return ready


def busy_poll_loop_factory(window_s: float) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A loop factory for :class:`asyncio.Runner` whose loops busy-poll for ``window_s``,
    or None (the default loop) when ``window_s`` is 0 or busy polling cannot work here
    (no C compiler, no pollable selector descriptor)."""
    if window_s <= 0:
        return None
    if not hasattr(selectors.DefaultSelector, "fileno"):
        log.warning("busy polling needs an epoll or kqueue selector: the loop sleeps as usual")
        return None
    spin = _spinner()
    if spin is None:
        log.warning("busy polling needs its C helper (no C compiler?): the loop sleeps as usual")
        return None
    log.info("busy polling: the event loop spins for %.1f ms after network activity", window_s * 1e3)
    return lambda: asyncio.SelectorEventLoop(BusyPollSelector(window_s, spin))
