"""The one timer a sans-IO control machine asks for, kept on the event loop.

:class:`~meshnode.mesh.stage_control_coordinator.CoordinatorControl` and
:class:`~meshnode.mesh.stage_control_server.StageServerControl` never read a clock: each
says when it next wants ``handle_timer(now)`` (``get_timer()``, in the clock its driver
feeds it) and the driver re-arms one loop timer after every feed. This is that timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol


class _TimedControl(Protocol):
    def get_timer(self) -> float | None: ...
    def handle_timer(self, now: float) -> None: ...


class ControlTimer:
    """Keeps one loop timer at ``control.get_timer()``; when it fires, feeds the machine
    ``handle_timer(clock())`` and calls ``after()`` (the driver drains the machine)."""

    __slots__ = ("_control", "_clock", "_after", "_handle")

    def __init__(self, control: _TimedControl, clock: Callable[[], float], after: Callable[[], None]) -> None:
        self._control = control
        self._clock = clock
        self._after = after
        self._handle: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        """Re-arm at the time the machine names now (after every feed); none if it names none."""
        self.cancel()
        when = self._control.get_timer()
        if when is not None:
            self._handle = asyncio.get_running_loop().call_later(max(0.0, when - self._clock()), self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        self._control.handle_timer(self._clock())
        self._after()
