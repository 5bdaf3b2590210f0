"""Progress reporting for long model operations (download, extract, hash, slice).

A progress hook is any callable ``hook(phase, done, total)``: ``phase`` is a short label
("download", "extract", "hash", "slice"), ``done`` the units finished so far (bytes),
``total`` the expected units or None when unknown. Hooks are called from the worker that
does the job, often many times a second; a TUI should coalesce them.

:class:`TqdmProgress` is the terminal implementation (bars on stderr) used by the CLI.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

ProgressFn = Callable[[str, int, "int | None"], None]


class TqdmProgress:
    """A progress hook that draws one tqdm bar per phase on stderr.

    Use as a context manager (or call :meth:`close`) so the last bar is finished.
    """

    def __init__(self, *, disable: bool | None = None) -> None:
        self._disable = disable
        self._bar: Any = None
        self._phase: str | None = None

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        from tqdm import tqdm

        if phase != self._phase:
            self.close()
            self._phase = phase
            self._bar = tqdm(
                total=total, desc=phase, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, disable=self._disable, leave=False,
            )
        bar = self._bar
        if total is not None and bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            self._phase = None

    def __enter__(self) -> "TqdmProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def report(progress: ProgressFn | None, phase: str, done: int, total: int | None) -> None:
    """Call ``progress`` if there is one."""
    if progress is not None:
        progress(phase, done, total)
