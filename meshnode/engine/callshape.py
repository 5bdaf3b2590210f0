"""Whether a GPU engine's small calls should stay wide after a verify window, decided by
timing this engine once at load (docs/engine.md "Call shapes and CUDA graphs").

llama.cpp replays a captured CUDA graph while consecutive calls keep one shape and runs a
call without one when the shape changes. A speculating route's target stage alternates
padded one-row steps with windows of 3-4 rows, so without care most of its calls lose
their graph. Running the small calls as wide as the windows (``StageEngine._width``)
keeps one shape at the price of the extra rows. Which costs less depends on the model
and the GPU (an H200: SmolLM2's shape 0.3 ms for the rows against ~3 ms a lost graph;
an 8B shape 1.3 ms against ~1.1 ms), so each engine measures it: a step at its pad
width in a run of them, the same step at the wide width in a run of them, and the two
widths alternating. Wide calls win when a wide step in a run costs less than the mean
of a narrow step in a run and a step after a change: what a step costs without them when
about half the calls come after a shape change (a speculating route: each window is a
change in and a change out, and a draft strategy's windows vary in size). On an H200
that keeps SmolLM2's shape wide (1.80 ms against (1.56 + 5.16) / 2); an 8B shape sits at
the edge (narrow at 4.89 against (3.84 + 5.10) / 2 on one machine, wide at 5.02 against
(3.81 + 6.44) / 2 on another).

The result picks call shapes only: every shape it may pick is exact (certify --schedule).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

# timed calls of each pattern, after WARM_CALLS untimed ones (a capture takes two calls)
TIMED_CALLS = 8
WARM_CALLS = 3


@dataclass(frozen=True, slots=True)
class CallShapeTimes:
    """Milliseconds per call (medians): ``narrow`` a one-row step at the pad width in a
    run of them, ``wide`` the same step ``wide_rows`` rows wide in a run of them,
    ``changing`` steps alternating the two widths (each call a new shape)."""

    narrow_rows: int
    wide_rows: int
    narrow: float
    wide: float
    changing: float

    # the share of a speculating route's calls that come after a shape change, assumed
    CHANGED_SHARE = 0.5

    @property
    def wide_wins(self) -> bool:
        return self.wide < self.narrow + self.CHANGED_SHARE * (self.changing - self.narrow)

    def summary(self) -> str:
        return (f"{self.narrow_rows}-row steps {self.narrow:.2f} ms, {self.wide_rows}-row "
                f"{self.wide:.2f} ms, alternating {self.changing:.2f} ms")


def time_call_shapes(step: Callable[[int], None], narrow_rows: int, wide_rows: int,
                     clock: Callable[[], float] = time.perf_counter) -> CallShapeTimes:
    """Time ``step(rows)`` (one one-row step run ``rows`` rows wide, leaving the engine as
    it found it) in the three patterns of :class:`CallShapeTimes`."""

    def run(widths: list[int]) -> float:
        for w in widths[:WARM_CALLS]:
            step(w)
        times = []
        for w in widths[WARM_CALLS:]:
            t = clock()
            step(w)
            times.append(clock() - t)
        return 1e3 * statistics.median(times)

    n = WARM_CALLS + TIMED_CALLS
    narrow = run([narrow_rows] * n)
    wide = run([wide_rows] * n)
    changing = run([(narrow_rows, wide_rows)[i % 2] for i in range(n)])
    return CallShapeTimes(narrow_rows, wide_rows, narrow, wide, changing)
