"""Continuous batching at stage 0.

Every active request submits one step at a time (a prefill chunk, a decode step or a
verify window) and awaits its result; a lone stream on a split may have a second one
queued behind it (a lookahead window, :mod:`meshnode.spec.lookahead`), and a session's
steps always travel in separate batches, in order. The scheduler coalesces the steps that are
waiting into one :meth:`Pipeline.run` call, so all decoding sessions advance together
through one engine call per stage.

On a split, the decoding sessions are dealt into *lanes*, one per stage: a batch takes
at most ``ceil(decoding / n_stages)`` sessions and up to ``n_stages`` batches are in
flight, so while stage 1 computes lane A, stage 0 already computes lane B. One batch
of every session would leave each stage idle while the others work (a lone stream
cannot be pipelined: its next token needs the last one). Lanes form by themselves:
a returning batch's sessions submit together and leave together again.

A step that the loop would run at once (nothing else waiting, every decoding session
accounted for, a batch slot free: a lone stream's next step) is dispatched by
:meth:`BatchScheduler.enqueue` itself, which saves the loop's wake-up on every token.

Batches stay small enough for batch invariance (docs/engine.md: identical logits up to
32 rows); a prefill chunk larger than that travels alone, exactly as on a single node.

The pipeline belongs to the mesh and fails with the mesh's errors, which reach the
waiters as they are (serve/errors.py's table gives them their HTTP status). A failure is
handed only to the waiters it concerns: a batch that failed as a whole (``run`` raised)
fails every waiter of it; a step that failed alone (a ``StepFailedError`` in its place,
e.g. its sampling raised) fails its own waiter, and the others get their tokens.

After a failover the model server hands the scheduler the new route's pipeline
(:meth:`BatchScheduler.set_pipeline`): steps still waiting, and steps queued later for
the old route (``enqueue(step, epoch)``), fail as unavailable, since their sessions have
no KV on the new route until they replay (:mod:`meshnode.serve.failover`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from meshnode.limits import MAX_VERIFY_WINDOW
from meshnode.mesh.final import Finalized
from meshnode.mesh.pipeline import Pipeline, PipelineFailedError, PipelineUnavailableError, Step

log = logging.getLogger(__name__)

GATHER_S = 0.002   # longest wait for the other decoding sessions to submit


class _Slots:
    """Batches in flight on one route: at most ``n``. Taken at once when one is free
    (:meth:`BatchScheduler.enqueue`'s direct path), awaited by the loop otherwise."""

    def __init__(self, n: int) -> None:
        self.free = n
        self._freed = asyncio.Event()

    def try_take(self) -> bool:
        if self.free > 0:
            self.free -= 1
            return True
        return False

    async def take(self) -> None:
        while not self.try_take():
            self._freed.clear()
            await self._freed.wait()

    def give(self) -> None:
        self.free += 1
        self._freed.set()


class BatchScheduler:
    def __init__(self, pipeline: Pipeline, *, max_rows: int = MAX_VERIFY_WINDOW, max_inflight: int | None = None) -> None:
        self.pipeline = pipeline
        self.max_rows = max_rows
        self._pending: list[tuple[Step, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._max_inflight = max_inflight
        self._slots = _Slots(max_inflight or max(1, pipeline.n_stages))
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batch-scheduler")
        self._running: set[asyncio.Task] = set()
        self.batches = 0
        self.rows = 0
        self._decoding: set[int] = set()    # sessions in their decode loop
        self._in_flight: set[int] = set()   # sessions whose step is being computed
        self.epoch = 0                      # the route: counts set_pipeline calls
        # batches that shared the route: with steps of several sessions, or sent while
        # another session's batch was in flight (see :meth:`ran_alone`)
        self.company = 0

    def set_pipeline(self, pipeline: Pipeline) -> None:
        """Run later batches on ``pipeline`` (a new route): the steps still waiting were
        meant for the old one and fail as unavailable."""
        self.pipeline = pipeline
        self.epoch += 1
        self._slots = _Slots(self._max_inflight or max(1, pipeline.n_stages))
        stale, self._pending = self._pending, []
        for _, fut in stale:
            if not fut.done():
                fut.set_exception(PipelineUnavailableError("the route changed"))

    # Sessions in their decode loop announce themselves, so a batch can wait (briefly)
    # until every one of them has submitted its next step instead of leaving half behind.
    def enter(self, session: int) -> None:
        self._decoding.add(session)

    def leave(self, session: int) -> None:
        self._decoding.discard(session)
        self._wake.set()

    @property
    def decoding(self) -> int:
        """Sessions in their decode loop now."""
        return len(self._decoding)

    def ran_alone(self, company: int) -> bool:
        """Whether a step sent when :attr:`company` was ``company``, whose result is here
        now, had the route to itself: no batch shared the route since. Only such a step's
        time says what its shape costs; one that shared a call or a stage with another
        request's steps measured the load (a window learned under a burst looked five
        times a plain step on one node, and kept that cost once the burst was over)."""
        return company == self.company

    def _all_ready(self) -> bool:
        waiting = {step.session for step, _ in self._pending}
        return self._decoding - self._in_flight <= waiting

    def enqueue(self, step: Step, epoch: int | None = None) -> asyncio.Future:
        """Queue ``step``; the future gets its result. Cancel it to withdraw the step
        (it is skipped if it has not been sent yet). ``epoch``: the route the step's
        session has its KV on (None: the current one); an older one fails at once."""
        fut = asyncio.get_running_loop().create_future()
        if epoch is not None and epoch != self.epoch:
            fut.set_exception(PipelineUnavailableError("the route changed"))
            return fut
        idle = not self._pending and not self._wake.is_set()
        self._pending.append((step, fut))
        if idle and self._all_ready() and self._slots.try_take():
            self._dispatch(self._take(), self._slots)   # what the loop would do now, a wake-up sooner
        else:
            self._wake.set()
        return fut

    async def submit(self, step: Step, epoch: int | None = None) -> Finalized | None:
        return await self.enqueue(step, epoch)

    def lane_size(self) -> int:
        """Most sessions in one batch: all of them on one node, a lane's share on a split."""
        lanes = max(1, self.pipeline.n_stages)
        active = max(len(self._decoding), len({step.session for step, _ in self._pending}))
        return max(1, -(-active // lanes))

    def _take(self) -> list[tuple[Step, asyncio.Future]]:
        # a step whose submitter gave up before it ran (a dropped lookahead, a cancelled
        # request) is not run at all
        self._pending = [item for item in self._pending if not item[1].done()]
        if not self._pending:
            return []
        first_step, _ = self._pending[0]
        n = int(first_step.tokens.shape[0])
        batch = [self._pending.pop(0)]
        if n > self.max_rows:
            return batch  # a big prefill chunk runs alone (same schedule as one node)
        keep = []
        sessions = {first_step.session}
        cap = self.lane_size()
        while self._pending:
            item = self._pending.pop(0)
            rows = int(item[0].tokens.shape[0])
            if item[0].session in sessions or n + rows > self.max_rows or len(sessions) >= cap:
                keep.append(item)
                continue
            batch.append(item)
            sessions.add(item[0].session)
            n += rows
        self._pending[:0] = keep
        return batch

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            # Let the sessions woken by the same batch submit too (bounded: a slow one
            # must not hold the others back).
            deadline = asyncio.get_running_loop().time() + GATHER_S
            while not self._all_ready() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0)
            while self._pending:
                slots = self._slots
                await slots.take()
                if slots is not self._slots:   # the route changed meanwhile
                    slots.give()
                    continue
                batch = self._take()   # [] when every waiting step was withdrawn meanwhile
                if not batch:
                    slots.give()
                    break
                self._dispatch(batch, slots)

    def _dispatch(self, batch: list[tuple[Step, asyncio.Future]], slots: _Slots) -> None:
        """Run ``batch`` (holding one of ``slots``) on the current pipeline."""
        # in flight from now on, so that the other sessions' gathering counts them
        sessions = [s.session for s, _ in batch]
        # (a session's own lookahead riding behind its window is not company)
        if len(set(sessions)) > 1 or not self._in_flight <= set(sessions):
            self.company += 1
        self._in_flight.update(sessions)
        task = asyncio.get_running_loop().create_task(self._run(batch, sessions, self.pipeline, slots))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, batch: Sequence[tuple[Step, asyncio.Future]], sessions: list[int],
                   pipeline: Pipeline, slots: _Slots) -> None:
        # withdrawn between _take and now: must not reach the engine (its session may be
        # gone already, and its KV would never be freed)
        batch = [item for item in batch if not item[1].done()]
        if not batch:
            self._in_flight.difference_update(sessions)
            slots.give()
            return
        steps = [s for s, _ in batch]
        try:
            results = await pipeline.run(steps)
            self.batches += 1
            self.rows += sum(int(s.tokens.shape[0]) for s in steps)
            if len(results) != len(steps):   # a pipeline bug: no waiter may hang on it
                raise PipelineFailedError(f"the pipeline returned {len(results)} results for {len(steps)} steps")
            for (_, fut), res in zip(batch, results):
                if fut.done():
                    continue
                if isinstance(res, Exception):   # this step's own failure
                    fut.set_exception(res)
                else:
                    fut.set_result(res)
        except Exception as exc:  # noqa: BLE001 - the whole batch failed: every waiter gets it
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
        finally:
            self._in_flight.difference_update(sessions)
            slots.give()

    async def close(self) -> None:
        self._task.cancel()
        for t in list(self._running):
            t.cancel()
        for _, fut in self._pending:
            if not fut.done():
                fut.cancel()
        self._pending.clear()
