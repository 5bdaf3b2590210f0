"""How many CPU threads llama.cpp computes with: as many as the machine has free.

llama.cpp's CPU threads meet at a barrier after every graph operation, so a call is as
slow as its slowest thread. Beside another busy process one of a node's threads keeps
losing its core, and a node with a thread per core slowed 3-5x on a 2-core VM (docs/
engine.md, "Threads and a busy machine"), where one thread fewer would have cost it
about half. No reading of the machine's load says what is free (the load average lags
by a minute and counts our own threads), so the engine measures: now and then it runs a
few calls with another count, and keeps that count when those calls were faster than
the same calls just before.

Speed is flat over most counts and falls off a cliff once the threads outnumber the free
cores (a 16-core host beside 4 busy processes: 15 threads as slow as 16), so a try of one
thread more or fewer would never find the edge. The tries are a pattern search: the
first goes half the count away, a kept count is tried further the same way, and the
distance halves each time both ways failed, down to one thread. A count is kept when
its calls were faster at all (a median of 4 against the 4 before), either way: a
margin stalls a search on the flat stretch, or (for one way only) lets noise drift the
count the other way; without one, noise moves the count as often up as down and the
next tries undo it (a model of a machine whose calls vary +-20% at
random loses under 4% that way; tests/test_thread_governor.py). On an idle machine the
tries cost little (they get rarer while they keep failing, up to one in MAX_INTERVAL
calls); when calls get much slower or faster (the machine got busier or freer) the search
starts again from far.

A count never changes a result (the q8_0 KV cache's flash attention computes every
(row, head) on one thread, and each matmul row is one thread's dot product: docs/
engine.md, "Batch invariance"), so the engine adapts only where that holds.

A try runs only calls of one shape (number of rows), the most frequent since the last
try (one-row decode steps, as a rule): the prefill chunks and verify windows between
them keep the settled count, so a try does not make the big calls slow.

Sans-IO: the engine asks :meth:`ThreadGovernor.threads_for` the count for a call and
tells :meth:`ThreadGovernor.observe` what the call cost.
"""

from __future__ import annotations

import logging
from collections import deque
from statistics import median

log = logging.getLogger(__name__)

TRIAL_CALLS = 4          # calls of one shape at the tried count before comparing
FIRST_INTERVAL = 32      # calls between tries after a change
MAX_INTERVAL = 512       # ... doubling while tries fail, up to this
SLOWDOWN = 1.5           # calls this much slower (or faster) than when settled: search again


class ThreadGovernor:
    """The thread count for an engine's next call, from what its calls cost.

    Calls are compared only with calls of the same number of rows (a prefill chunk and a
    decode step are not alike). ``most`` is the count configured (``--threads``, or every
    core); the governor stays within 1..``most``.
    """

    def __init__(self, most: int) -> None:
        if most < 1:
            raise ValueError(f"thread count must be positive, got {most}")
        self.most = most
        self.threads = most
        self.changes = 0
        self._interval = FIRST_INTERVAL
        self._since = 0
        self._recent: dict[int, deque[float]] = {}    # rows -> last calls' seconds at self.threads
        self._settled: dict[int, float] = {}         # rows -> median when last settled
        self._restart_search(down=True)
        self._trial: int | None = None
        self._trial_rows = 0
        self._trial_calls: list[float] = []
        self._trial_left = 0
        self._shapes: dict[int, int] = {}     # rows -> calls since the last try

    @property
    def trying(self) -> int | None:
        """The count being tried now, if any."""
        return self._trial

    def threads_for(self, rows: int) -> int:
        """The thread count for a call of ``rows`` rows."""
        return self._trial if self._trial is not None and rows == self._trial_rows else self.threads

    def observe(self, rows: int, seconds: float, threads: int) -> None:
        """Record that a call of ``rows`` rows took ``seconds`` with ``threads`` threads."""
        if self._trial is not None:
            self._trial_left -= 1
            if threads == self._trial and rows == self._trial_rows:
                self._observe_trial(seconds)
                return
            if self._trial_left <= 0:       # the shape does not come back: leave it for now
                self._reject()
        if threads != self.threads:
            return
        recent = self._recent.setdefault(rows, deque(maxlen=TRIAL_CALLS))
        recent.append(seconds)
        if self._trial is not None or len(recent) < TRIAL_CALLS:
            return
        self._since += 1
        self._shapes[rows] = self._shapes.get(rows, 0) + 1
        now = median(recent)
        settled = self._settled.setdefault(rows, now)
        if not settled / SLOWDOWN <= now <= SLOWDOWN * settled:
            self._settled[rows] = now
            self._interval = FIRST_INTERVAL
            self._since = self._interval
            self._restart_search(down=now > settled)
        if self._since >= self._interval and self._shapes[rows] == max(self._shapes.values()):
            self._start_trial(rows)

    def _restart_search(self, *, down: bool) -> None:
        self._down = down                       # the direction of the next try
        self._step = max(1, self.most // 2)     # how far it goes
        self._failed: set[bool] = set()         # directions that failed at this step

    def _start_trial(self, rows: int) -> None:
        choice = self._next_choice()
        if choice is None:
            return
        self._trial = choice
        self._trial_rows = rows
        self._trial_calls = []
        self._trial_left = 16 * TRIAL_CALLS      # calls of other shapes may come between

    def _next_choice(self) -> int | None:
        """The count to try next (None: there is no other count)."""
        for _ in range(2 * self.most.bit_length() + 4):
            if len(self._failed) == 2:          # both ways failed at this distance: come closer
                self._step = max(1, self._step // 2)
                self._failed = set()
            if self._down in self._failed:
                self._down = not self._down
            goal = self.threads - self._step if self._down else self.threads + self._step
            choice = max(1, min(self.most, goal))    # as far as that way goes
            if choice != self.threads:
                return choice
            self._failed.add(self._down)         # nothing that way
        return None

    def _observe_trial(self, seconds: float) -> None:
        self._trial_calls.append(seconds)
        if len(self._trial_calls) < TRIAL_CALLS:
            return
        before = median(self._recent[self._trial_rows])
        tried = median(self._trial_calls)
        log.debug("%d-row calls with %s threads: %.2f ms against %.2f with %d: %s", self._trial_rows,
                  self._trial, 1e3 * tried, 1e3 * before, self.threads, "kept" if tried < before else "not kept")
        if tried < before:
            self._adopt()
        else:
            self._reject()

    def _adopt(self) -> None:
        assert self._trial is not None
        self.threads = self._trial
        self.changes += 1
        # what other shapes cost at the old count says nothing about the new one
        self._recent = {self._trial_rows: deque(self._trial_calls, maxlen=TRIAL_CALLS)}
        self._settled = {self._trial_rows: median(self._trial_calls)}
        self._interval = FIRST_INTERVAL   # and try further the same way soon
        self._failed = set()
        self._end_trial()

    def _reject(self) -> None:
        self._interval = min(2 * self._interval, MAX_INTERVAL)
        self._failed.add(self._down)
        self._end_trial()

    def _end_trial(self) -> None:
        self._trial = None
        self._trial_calls = []
        self._since = 0
        self._shapes = {}
