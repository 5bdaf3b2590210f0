"""Continuous batching at stage 0 (pure scheduling logic, fake pipeline)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from meshnode.mesh.final import Finalized
from meshnode.mesh.pipeline import PipelineFailedError, PipelineUnavailableError, Step
from meshnode.serve.scheduler import BatchScheduler


class _RecordingPipeline:
    """Takes ``delay`` per batch and records which sessions each batch held and when."""

    def __init__(self, n_stages: int, delay: float = 0.01) -> None:
        self.n_stages = n_stages
        self.delay = delay
        self.batches: list[tuple[frozenset[int], float, float]] = []

    async def run(self, steps):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.sleep(self.delay)
        self.batches.append((frozenset(s.session for s in steps), t0, loop.time()))
        return [Finalized((7,), 0, 0) for _ in steps]

    async def end_session(self, session: int) -> None: ...

    async def close(self) -> None: ...


async def _decode(n_sessions: int, n_stages: int, steps: int = 6) -> _RecordingPipeline:
    pipe = _RecordingPipeline(n_stages)
    sched = BatchScheduler(pipe)

    # Every session is in its decode loop before the first submits (as on a node where
    # they decode together): a step submitted while its session is alone may run at once.
    for sid in range(n_sessions):
        sched.enter(sid)

    async def session(sid: int) -> None:
        try:
            for pos in range(steps):
                res = await sched.submit(Step(sid, pos, np.asarray([1], dtype=np.int32)))
                assert res.tokens == (7,)
        finally:
            sched.leave(sid)

    await asyncio.gather(*(session(i) for i in range(n_sessions)))
    await sched.close()
    return pipe


def test_one_node_batches_every_decoding_session_together():
    pipe = asyncio.run(_decode(4, n_stages=1))
    assert [len(b) for b, _, _ in pipe.batches] == [4] * 6


@pytest.mark.parametrize(("n_sessions", "n_stages", "lane"), [(4, 2, 2), (8, 2, 4), (8, 3, 3), (5, 2, 3)])
def test_a_split_deals_sessions_into_one_lane_per_stage(n_sessions, n_stages, lane):
    pipe = asyncio.run(_decode(n_sessions, n_stages))
    sizes = [len(b) for b, _, _ in pipe.batches]
    assert max(sizes) == lane
    assert sum(sizes) == n_sessions * 6           # every step ran exactly once
    # Lanes overlap in time: some batch started before the previous one finished,
    # which is what keeps every stage of a pipeline busy.
    starts = sorted((t0, t1) for _, t0, t1 in pipe.batches)
    assert any(b0 < a1 for (_, a1), (b0, _) in zip(starts, starts[1:]))


def test_a_lone_stream_is_never_split():
    pipe = asyncio.run(_decode(1, n_stages=3))
    assert [len(b) for b, _, _ in pipe.batches] == [1] * 6


def test_a_step_the_loop_would_run_at_once_starts_without_its_wake_up():
    """A lone stream's step is dispatched by enqueue itself: it reaches the pipeline in
    the next loop iteration (through the scheduler's loop it would take two); a step
    that must wait for another session's is left to the loop."""
    async def main() -> tuple[int, int]:
        pipe = _RecordingPipeline(2, delay=0.01)
        started = []
        run = pipe.run

        async def recording_run(steps):
            started.append(steps[0].session)
            return await run(steps)

        pipe.run = recording_run
        sched = BatchScheduler(pipe)
        sched.enter(1)
        lone = sched.enqueue(Step(1, 0, np.asarray([1], dtype=np.int32)))
        await asyncio.sleep(0)
        at_once = len(started)
        await lone
        sched.enter(2)    # now a batch waits for session 2's step too (up to GATHER_S)
        both = sched.enqueue(Step(1, 1, np.asarray([1], dtype=np.int32)))
        await asyncio.sleep(0)
        waited = len(started) - at_once
        await sched.submit(Step(2, 0, np.asarray([1], dtype=np.int32)))
        await both
        await sched.close()
        return at_once, waited

    assert asyncio.run(main()) == (1, 0)


def test_a_withdrawn_step_never_runs():
    async def main() -> list:
        pipe = _RecordingPipeline(2, delay=0.02)
        sched = BatchScheduler(pipe)
        sched.enter(1)
        first = sched.enqueue(Step(1, 0, np.asarray([1], dtype=np.int32)))
        ahead = sched.enqueue(Step(1, 1, np.asarray([2], dtype=np.int32)))
        late = sched.enqueue(Step(1, 2, np.asarray([3], dtype=np.int32)))
        late.cancel()               # withdrawn before the scheduler took it
        assert (await first).tokens == (7,)
        assert (await ahead).tokens == (7,)
        sched.leave(1)
        await sched.close()
        return pipe.batches

    batches = asyncio.run(main())
    # one session's steps travel in separate batches, in order; the withdrawn one not at all
    assert [sorted(b) for b, _, _ in batches] == [[1], [1]]
    assert batches[0][1] <= batches[1][1]


class _FailingPipeline(_RecordingPipeline):
    def __init__(self, exc: Exception) -> None:
        super().__init__(1)
        self.exc = exc

    async def run(self, steps):
        raise self.exc


@pytest.mark.parametrize(("raised", "status"), [
    (PipelineUnavailableError("link lost"), 503),
    (PipelineFailedError("stage on b failed: boom"), 500),
])
def test_pipeline_errors_reach_the_waiters_and_map_to_http(raised, status):
    """The pipeline (mesh) fails with mesh errors; a waiting request sees that error, and
    serve/errors.py's one table answers it 503 / 500 as before."""
    from meshnode.serve.errors import error_spec

    async def main() -> BaseException:
        sched = BatchScheduler(_FailingPipeline(raised))
        with pytest.raises(type(raised)) as info:
            await sched.submit(Step(1, 0, np.asarray([1], dtype=np.int32)))
        await sched.close()
        return info.value

    err = asyncio.run(main())
    assert err is raised
    assert error_spec(err).status == status


def test_other_pipeline_errors_pass_through_unchanged():
    async def main() -> None:
        boom = RuntimeError("boom")
        sched = BatchScheduler(_FailingPipeline(boom))
        with pytest.raises(RuntimeError) as info:
            await sched.submit(Step(1, 0, np.asarray([1], dtype=np.int32)))
        assert info.value is boom
        await sched.close()

    asyncio.run(main())
