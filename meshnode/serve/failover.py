"""Failover of requests in flight: waiting for a new route, and replaying a session.

Theory of operation
-------------------
When a stage of the model is lost, the model service re-plans (``serve/service.py``)
and the model server's :class:`RouteGate` goes *down* before any waiting step fails,
so the request that sees its step fail can tell a lost route (wait, then resume) from
its own failure (report it). The gate counts routes: a step that failed on route
``epoch`` resumes once a later route is *up*, or fails with the re-plan's reason when
the gate is *failed* (no plan fits the members that remain).

On the new route every stage's KV of the session is empty. :func:`replay_steps` gives
the steps that rebuild it from the token history (prompt plus the tokens generated so
far, except the last one, which the next decode step feeds as usual), with the batch
schedule of a cold run: the prompt in the same prefill chunks, the generated tokens in
chunks that the new route computes exactly as one-row steps (the decode and verify steps
that first computed them were such steps or windows within the same bound): up to
``limits.MAX_VERIFY_WINDOW`` rows on CPU stages, on a GPU stage no wider than its exact
verify window and never across a KV bucket its one-row steps would cross
(``spec/window.py``, ``RouteWindows.exact_rows_at``). So every row's KV is bit-identical
to the lost one and greedy output continues exactly.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from meshnode.limits import MAX_VERIFY_WINDOW
from meshnode.mesh.final import GREEDY, NO_COUNTS, Counts, Sampling, recent_tokens
from meshnode.mesh.pipeline import PipelineUnavailableError, Step

__all__ = ["RouteGate", "replay_steps"]


class RouteGate:
    """The state of the model's route, as requests in flight see it (see the module
    docstring). ``epoch`` counts routes; ``up`` is False from the loss until the
    re-plan ends; ``failure`` says why no route was found (then later waits fail at once)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.up = True
        self.failure: str | None = None
        self.reason = ""
        self.waiting = 0          # requests waiting now (telemetry: the failover event)
        self._changed = asyncio.Event()

    def lost(self, reason: str) -> None:
        """The route is gone; a re-plan is under way."""
        self.up, self.failure, self.reason = False, None, reason
        self._changed.set()
        self._changed = asyncio.Event()

    def restored(self) -> None:
        """A new route serves (the model server switched its pipeline first)."""
        self.epoch += 1
        self.up, self.failure = True, None
        self._changed.set()
        self._changed = asyncio.Event()

    def failed(self, reason: str) -> None:
        """No route: waiting requests and later ones fail with ``reason``."""
        self.up, self.failure = False, reason
        self._changed.set()
        self._changed = asyncio.Event()

    def changed_since(self, epoch: int) -> bool:
        """Whether the route a step was sent on (``epoch``) is gone or being replaced."""
        return self.epoch != epoch or not self.up

    async def wait_lost(self, epoch: int, timeout: float) -> bool:
        """After a step on ``epoch`` failed as unreachable before the loss was declared:
        wait up to ``timeout`` s for the declaration. True when the route changed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.changed_since(epoch):
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return self.changed_since(epoch)
        return True

    async def wait_up(self, timeout: float) -> int:
        """Wait for a route to serve; returns its epoch. Raises
        :class:`PipelineUnavailableError` when the re-plan found none, or after ``timeout`` s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.waiting += 1
        try:
            while not self.up:
                if self.failure is not None:
                    raise PipelineUnavailableError(f"no route to the model's stages: {self.failure}")
                left = deadline - loop.time()
                if left <= 0:
                    raise PipelineUnavailableError(f"no route to the model's stages within {timeout:.0f} s"
                                                   f" ({self.reason})")
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    pass
            return self.epoch
        finally:
            self.waiting -= 1


def replay_steps(session: int, history: Sequence[int], n_prompt: int, n_batch: int, *,
                 rows_at: Callable[[int], int] | None = None,
                 sampling: Sampling = GREEDY, check_last: bool = False) -> list[Step]:
    """The steps that rebuild ``session``'s KV at positions ``[0, len(history))``.

    ``history``: the prompt (``n_prompt`` tokens) and then generated tokens. The prompt
    goes in ``n_batch`` chunks from position 0, as its cold prefill did; the rest in
    chunks of at most ``rows_at(pos)`` rows for a chunk starting at ``pos`` (what the new
    route computes exactly as one-row steps; default ``MAX_VERIFY_WINDOW``, a CPU route's
    bound). No step wants logits, except the last one when ``check_last``: its token is
    the one the history continues with (a greedy request checks that the replayed KV
    predicts what the lost route did)."""
    if not 0 < n_prompt <= len(history):
        raise ValueError(f"history of {len(history)} tokens does not start with a prompt of {n_prompt}")
    if n_batch < 1:
        raise ValueError("n_batch must be >= 1")
    arr = np.asarray(history, dtype=np.int32)
    bounds = list(range(0, n_prompt, n_batch))
    pos = n_prompt
    while pos < len(arr):
        bounds.append(pos)
        pos += max(1, min(n_batch, MAX_VERIFY_WINDOW, rows_at(pos) if rows_at else MAX_VERIFY_WINDOW))
    bounds.append(len(arr))
    steps = [Step(session, a, arr[a:b], 0, (), sampling) for a, b in zip(bounds, bounds[1:])]
    if check_last and steps:
        last = steps[-1]
        # (what the lost route's step was penalized by)
        seen = NO_COUNTS
        if sampling.penalized:
            seen = Counts.of(Counter(history[n_prompt:]) if sampling.presence or sampling.frequency else {},
                             recent_tokens(history, sampling.repeat_last_n) if sampling.repeats else ())
        steps[-1] = Step(session, last.pos, last.tokens, 1, (), sampling, seen=seen)
    return steps
