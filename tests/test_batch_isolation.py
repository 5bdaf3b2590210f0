"""One failing request never fails the others in its batch (issue #17, finding 6).

Sampling is per session, so its failures are too: a session whose sampling raises at the
final stage (NaN logits, a value the sampler cannot take) fails alone, and the other
sessions of the same engine call get their tokens: on one node (LocalPipeline), on a
split's final stage (StageHost: a DataError naming the session, then the TokenReturn of
the others) and at stage 0 (MeshPipeline, then the scheduler handing each waiter its own
outcome). A failure of the engine call itself still fails the whole batch.

Pure logic: fake engines, an in-process fabric that carries real wire frames (encoded and
decoded) between stage 0 and the final stage. The same attack on a real model is in
tests/test_batch_isolation_real.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
from char_tokenizer import CharTokenizer

from meshnode import wire
from meshnode.mesh.final import FinalSampler, Finalized, Sampling
from meshnode.mesh.pipeline import (
    LocalPipeline,
    MeshPipeline,
    PipelineFailedError,
    Step,
    StepFailedError,
)
from meshnode.mesh.stage_host import StageHost, StageRoute
from meshnode.serve.client import GenerationRequest
from meshnode.serve.errors import error_body, error_spec
from meshnode.serve.model_server import ModelServer, ServeSettings
from meshnode.serve.scheduler import BatchScheduler
from meshnode.wire.messages import WHOLE_BATCH
from inproc import collect

N_EMBD, N_VOCAB = 4, 128
GOOD, BAD, OTHER = 0x1111, 0x2222, 0x3333


def truth(pos: int) -> int:
    """The greedy token after the row at ``pos`` (a lowercase letter)."""
    return 97 + (pos * 7) % 26


class _Engine:
    """A final stage (or a whole model): greedy choice ``truth(pos)``; ``poisoned``
    sessions get NaN logits (what a numerically broken sequence gives); ``fail`` makes
    the whole engine call raise."""

    def __init__(self, poisoned: frozenset[int] = frozenset()) -> None:
        self.poisoned = poisoned
        self.fail = False
        self.calls: list[tuple[int, ...]] = []   # sessions of each call

    def next_pos(self, session: int) -> int:
        return 1 << 30   # positions are not tracked: no step is a gap here

    def forward(self, segs, rewind=False):
        self.calls.append(tuple(s.session for s in segs))
        if self.fail:
            raise RuntimeError("llama_decode failed")
        out = []
        for s in segs:
            logits = np.zeros((s.n_logits, N_VOCAB), dtype=np.float32)
            first = s.pos + s.n_rows - s.n_logits
            for j in range(s.n_logits):
                logits[j, truth(first + j)] = 5.0
            if s.session in self.poisoned:
                logits[:] = np.nan
            out.append(logits)
        return out


class _Worker:
    """EngineWorker's surface, run inline."""

    def __init__(self, engine) -> None:
        self.engine = engine

    async def step(self, rows, fn, *args):
        return fn(*args)

    async def forward(self, segs, rewind=False):   # stage 0 of a split: hidden states
        if getattr(self.engine, "fail", False):
            raise RuntimeError("stage 0 failed")
        return [np.zeros((s.n_rows, N_EMBD), dtype=np.float32) for s in segs]

    async def drop(self, session): ...

    async def rollback(self, session, pos): ...

    async def close(self): ...


def _tok(*ids: int) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


# ---- the scheduler -----------------------------------------------------------------------


class _HalfFailing:
    """A pipeline whose result for session BAD is its own failure."""

    n_stages = 1

    def __init__(self) -> None:
        self.batches: list[tuple[int, ...]] = []

    async def run(self, steps):
        await asyncio.sleep(0.005)
        self.batches.append(tuple(s.session for s in steps))
        return [StepFailedError(s.session, "sampling failed: boom") if s.session == BAD
                else Finalized((ord("x"),), 0, 0) for s in steps]

    async def end_session(self, session): ...

    async def close(self): ...


def test_the_scheduler_hands_each_waiter_its_own_outcome():
    async def main():
        pipe = _HalfFailing()
        sched = BatchScheduler(pipe)
        for s in (GOOD, BAD):
            sched.enter(s)
        good = sched.enqueue(Step(GOOD, 0, _tok(1)))
        bad = sched.enqueue(Step(BAD, 0, _tok(1)))
        res = await asyncio.gather(good, bad, return_exceptions=True)
        await sched.close()
        return pipe.batches, res

    batches, (good, bad) = asyncio.run(main())
    assert batches == [(GOOD, BAD)]                 # one batch, as the attack needs
    assert good == Finalized((ord("x"),), 0, 0)
    assert isinstance(bad, StepFailedError) and bad.session == BAD
    # that request alone gets a 500 engine_failed with the reason
    assert error_spec(bad)[:3] == (500, "server_error", "engine_failed")
    assert "sampling failed" in error_body(bad)["error"]["message"]


def test_a_pipeline_that_drops_a_result_fails_its_batch_instead_of_hanging():
    class Short(_HalfFailing):
        async def run(self, steps):
            return [Finalized((1,), 0, 0)]

    async def main():
        sched = BatchScheduler(Short())
        sched.enter(GOOD)
        sched.enter(BAD)
        futs = [sched.enqueue(Step(GOOD, 0, _tok(1))), sched.enqueue(Step(BAD, 0, _tok(1)))]
        res = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 5)
        await sched.close()
        return res

    assert all(isinstance(r, PipelineFailedError) for r in asyncio.run(main()))


# ---- one node ------------------------------------------------------------------------------


def test_one_node_a_session_whose_sampling_fails_fails_alone():
    async def main():
        engine = _Engine(poisoned=frozenset({BAD}))
        pipe = LocalPipeline(_Worker(engine))
        window = Step(OTHER, 10, _tok(1, truth(10), 99), n_logits=3, drafts=(truth(10), 99))
        res = await pipe.run([Step(GOOD, 4, _tok(1)), Step(BAD, 4, _tok(1)), window,
                              Step(7, 0, _tok(1, 2), n_logits=0)])
        engine.fail = True
        with pytest.raises(Exception, match="llama_decode failed"):
            await pipe.run([Step(GOOD, 5, _tok(1)), Step(OTHER, 12, _tok(1))])
        return engine.calls, res

    calls, (good, bad, window, prefill) = asyncio.run(main())
    assert calls[0] == (GOOD, BAD, OTHER, 7)        # one engine call
    assert good == Finalized((truth(4),), 0, 0)
    assert isinstance(bad, StepFailedError) and bad.session == BAD and "NaN" in str(bad)
    assert window == Finalized((truth(10), truth(11)), 1, 2)   # first draft accepted, bonus
    assert prefill is None


# ---- the final stage of a split ------------------------------------------------------------


class _Fabric:
    """Records what a stage host sends; optionally hands it (as real frames) to stage 0."""

    def __init__(self, deliver=None) -> None:
        self.sent: list[tuple[str, wire.Message]] = []
        self.deliver = deliver

    async def send_data(self, node, msg, key) -> None:
        if not isinstance(msg, (bytes, bytearray, memoryview)):
            msg = wire.encode(msg)
        decoded = wire.decode(bytes(msg))
        self.sent.append((node, decoded))
        if self.deliver is not None:
            self.deliver(node, decoded)

    def send_lane(self, node, msg) -> bool:
        return False


def _forward(batch_id: int, *segs: tuple[int, int, int, tuple[int, ...]]) -> wire.Forward:
    """``segs``: (session, pos, n_rows, drafts); every row wants logits when drafts are
    given, else the last one."""
    ws = tuple(wire.Segment(session=s, pos=p, n_rows=n, n_logits=len(d) + 1, drafts=d,
                            temperature=0.0, top_k=0, top_p=1.0, seed=0, flags=0) for s, p, n, d in segs)
    rows = sum(n for _, _, n, _ in segs)
    return wire.Forward(ref=0, batch_id=batch_id, step=0, segments=ws,
                        act=np.arange(rows * N_EMBD, dtype=np.float32).reshape(rows, N_EMBD))


async def _host(engine, fabric) -> StageHost:
    return StageHost(fabric, _Worker(engine), StageRoute(coordinator="c", downstream=None))


async def _drain(host: StageHost) -> None:
    for _ in range(50):
        await asyncio.sleep(0)
    while host._queue.qsize():
        await asyncio.sleep(0.001)
    for _ in range(50):
        await asyncio.sleep(0)


def test_the_final_stage_answers_a_failed_session_apart_from_its_batch():
    async def main():
        engine, fabric = _Engine(poisoned=frozenset({BAD})), _Fabric()
        host = await _host(engine, fabric)
        host.accept("c", _forward(5, (GOOD, 0, 3, ()), (BAD, 0, 2, ()), (OTHER, 0, 1, ())))
        await _drain(host)
        engine.fail = True
        host.accept("c", _forward(6, (GOOD, 3, 1, ()), (OTHER, 1, 1, ())))
        await _drain(host)
        await host.close()
        return [m for _, m in fabric.sent]

    first_err, tokens, whole = asyncio.run(main())
    # the failed session's own DataError first, then the TokenReturn of the others
    assert isinstance(first_err, wire.DataError)
    assert (first_err.batch_id, first_err.session, first_err.code) == (5, BAD, wire.ErrorCode.ENGINE_ERROR)
    assert "NaN" in first_err.message
    assert isinstance(tokens, wire.TokenReturn) and tokens.batch_id == 5
    assert [(r.session, r.tokens) for r in tokens.results] == [(GOOD, (truth(2),)), (OTHER, (truth(0),))]
    # the engine call failing is still one DataError for the whole batch
    assert isinstance(whole, wire.DataError) and (whole.batch_id, whole.session) == (6, WHOLE_BATCH)


def test_a_session_ended_while_its_step_was_in_flight_is_left_out_not_its_batch():
    """A request cancelled while its step travels the fast lane ends its session on the
    stream, so the SessionEnd can reach a stage before that step's batch does: the
    batch's other sessions must still be computed."""

    async def main():
        engine, fabric = _Engine(), _Fabric()
        host = await _host(engine, fabric)
        host.accept("c", wire.SessionEnd(ref=0, session=BAD))
        host.accept("c", _forward(9, (BAD, 4, 1, ()), (GOOD, 7, 2, ())))
        host.accept("c", _forward(10, (BAD, 5, 1, ())))   # all of it ended: refused whole
        await _drain(host)
        await host.close()
        return engine.calls, [m for _, m in fabric.sent]

    calls, sent = asyncio.run(main())
    assert calls == [(GOOD,)]
    tokens, refused = sent
    assert isinstance(tokens, wire.TokenReturn)
    assert [(r.session, r.tokens) for r in tokens.results] == [(GOOD, (truth(8),))]
    assert isinstance(refused, wire.DataError) and refused.session == WHOLE_BATCH
    assert refused.code == wire.ErrorCode.NO_SUCH_SESSION


# ---- stage 0 of a split, against the final stage --------------------------------------------


class _Stage0Fabric:
    """Stage 0's fabric: frames to 'final' go (encoded, decoded) into a StageHost whose
    fabric delivers its answers back to the pipeline's on_data, as node.py does."""

    def __init__(self) -> None:
        self.host: StageHost | None = None

    def lane_ready(self, node) -> bool:
        return False

    async def send_data(self, node, msg, key) -> None:
        raw = bytes(msg) if isinstance(msg, (bytes, bytearray, memoryview)) else wire.encode(msg)
        assert self.host is not None
        self.host.accept("c", wire.decode(raw))


async def _split(poisoned: frozenset[int]) -> tuple[MeshPipeline, _Engine, StageHost]:
    engine = _Engine(poisoned)
    f0 = _Stage0Fabric()
    pipe = MeshPipeline(_Worker(_Engine()), f0, ["final"], reply_timeout=10.0)
    host = StageHost(_Fabric(deliver=lambda node, m: pipe.on_data("final", m)), _Worker(engine),
                     StageRoute(coordinator="c", downstream=None))
    f0.host = host
    return pipe, engine, host


def test_stage0_gives_each_session_of_a_split_batch_its_own_outcome():
    async def main():
        pipe, engine, host = await _split(frozenset({BAD}))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        res = await pipe.run([Step(GOOD, 0, _tok(1, 2, 3)), Step(BAD, 0, _tok(1, 2)),
                              Step(OTHER, 0, _tok(1, 2), n_logits=0)])
        # a batch of the failing session alone ends at once too (nothing else to wait for)
        alone = await pipe.run([Step(BAD, 2, _tok(1))])
        elapsed = loop.time() - t0
        # the engine failing still fails every step of the batch
        engine.fail = True
        with pytest.raises(PipelineFailedError) as whole:
            await pipe.run([Step(GOOD, 3, _tok(1)), Step(OTHER, 2, _tok(1))])
        await host.close()
        await pipe.close()
        return res, alone, elapsed, whole.value

    (good, bad, prefill), (alone,), elapsed, whole = asyncio.run(main())
    assert good == Finalized((truth(2),), 0, 0)
    assert isinstance(bad, StepFailedError) and bad.session == BAD and "NaN" in str(bad)
    assert prefill is None
    assert isinstance(alone, StepFailedError)
    assert elapsed < 5                                    # no reply timeout was waited for
    assert not isinstance(whole, StepFailedError) and "llama_decode failed" in str(whole)


def test_a_stage_cannot_fail_a_session_that_is_not_in_the_batch():
    """A DataError naming a session the batch does not hold is a failure of the whole
    batch (as before): it cannot leave a waiter hanging on a TokenReturn."""

    async def main():
        pipe, engine, host = await _split(frozenset())
        fut = asyncio.ensure_future(pipe.run([Step(GOOD, 0, _tok(1)), Step(OTHER, 0, _tok(1))]))
        host._task.cancel()          # the final stage never answers by itself
        await asyncio.sleep(0.01)
        (batch_id,) = pipe._pending
        pipe.on_data("final", wire.DataError(ref=0, batch_id=batch_id, session=BAD,
                                             code=wire.ErrorCode.ENGINE_ERROR, message="x"))
        with pytest.raises(PipelineFailedError) as info:
            await asyncio.wait_for(fut, 5)
        await pipe.close()
        return info.value

    assert not isinstance(asyncio.run(main()), StepFailedError)


# ---- the model server: two requests, one batch, one fails ----------------------------------


POISON_SEED = 666


def _poison_by_seed(monkeypatch) -> None:
    """The sampler raises for requests whose seed is POISON_SEED, from their third
    sampled step on (so they decode beside the others first)."""
    real = FinalSampler.finalize
    seen: dict[int, int] = {}

    def finalize(self, session, logits, drafts, sampling: Sampling, *rest):
        if sampling.seed == POISON_SEED:
            seen[session] = seen.get(session, 0) + 1
            if seen[session] >= 3:
                raise ValueError("poisoned on purpose")
        return real(self, session, logits, drafts, sampling, *rest)

    monkeypatch.setattr(FinalSampler, "finalize", finalize)


def test_the_model_server_fails_only_the_request_whose_sampling_failed(monkeypatch):
    _poison_by_seed(monkeypatch)

    async def main():
        engine = _Engine()
        server = ModelServer(ServeSettings("m", n_ctx=256), CharTokenizer(), LocalPipeline(_Worker(engine)))
        good = GenerationRequest("good", "m", prompt="hello", max_tokens=12, temperature=0.0)
        bad = replace(good, request_id="bad", prompt="world", seed=POISON_SEED)
        alone = await collect(server, good)
        together = await asyncio.gather(collect(server, good), collect(server, bad))
        await server.close()
        return engine.calls, alone, together

    calls, alone, (good, bad) = asyncio.run(main())
    assert any(len(c) == 2 for c in calls)             # the two shared engine calls
    assert isinstance(alone, str) and len(alone) == 12
    assert good == alone
    assert isinstance(bad, StepFailedError) and "poisoned on purpose" in str(bad)
    assert error_spec(bad).status == 500


def test_after_a_session_copy_neither_session_overtakes_it_on_the_fast_lane():
    """n > 1 prefills the prompt once, copies it, then feeds each choice's last token as a
    one-row step: lane material. Sent on the lane, such a step could reach the stage before
    the prefill and the copy (both on the ordered stream) and find no KV there."""

    class _LaneFabric(_Stage0Fabric):
        def lane_ready(self, node) -> bool:
            return True

    class _CopyWorker:
        async def copy(self, src, dst, n_pos) -> None:
            pass

    async def main():
        f = _LaneFabric()
        sent: list = []
        f.host = type("H", (), {"accept": lambda self, peer, m: sent.append(m)})()
        pipe = MeshPipeline(_CopyWorker(), f, ["final"], reply_timeout=10.0)
        await pipe.copy_session(GOOD, BAD, 3)
        return [pipe._lane_eligible([Step(s, 3, _tok(1))]) for s in (GOOD, BAD, OTHER)], sent

    eligible, sent = asyncio.run(main())
    assert eligible == [False, False, True]
    assert [type(m).__name__ for m in sent] == ["SessionCopy"]


def test_stage0_ends_a_session_through_stage_1_only():
    """The end of a session enters the route where its frames and copies do (stage 1
    relays it: tests/test_stage_host.py), so it cannot overtake them or be overtaken."""

    class Recording:
        def __init__(self) -> None:
            self.sent: list[tuple[str, object]] = []

        def lane_ready(self, node) -> bool:
            return False

        async def send_data(self, node, msg, key) -> None:
            self.sent.append((node, msg))

    async def main():
        fabric = Recording()
        pipe = MeshPipeline(_Worker(_Engine()), fabric, ["b", "c", "d"], reply_timeout=10.0)
        await pipe.end_session(7)
        await pipe.close()
        return fabric.sent

    sent = asyncio.run(main())
    assert [(node, type(m).__name__, m.session) for node, m in sent] == [("b", "SessionEnd", 7)]


# ---- prompt scoring (echo) ------------------------------------------------------------------


def test_a_scored_prompt_chunk_gives_the_same_scores_on_one_node_and_a_split():
    """Rows scored against the prompt's next tokens, then the last row sampled; or only
    scored (a chunk before the last). Through real wire frames on the split."""
    lp = Sampling(top_logprobs=1)
    steps = [Step(GOOD, 0, _tok(1, 2, 3, 4), n_logits=4, sampling=lp, score=(truth(0), 5, truth(2))),
             Step(OTHER, 0, _tok(1, 2, 3), n_logits=3, sampling=lp, score=(7, truth(1), 9))]

    async def main():
        local = await LocalPipeline(_Worker(_Engine())).run(steps)
        pipe, _, host = await _split(frozenset())
        split = await pipe.run(steps)
        await host.close()
        await pipe.close()
        return local, split

    local, split = asyncio.run(main())
    assert local == split
    sampled, only = local
    assert sampled.tokens == (truth(3),) and only.tokens == ()
    best, other = 5 - np.log(np.exp(5) + N_VOCAB - 1), -np.log(np.exp(5) + N_VOCAB - 1)
    assert np.allclose(sampled.scored.logprobs, (best, other, best))
    assert sampled.scored.top(1) == [(truth(1), pytest.approx(best))]
    assert np.allclose(only.scored.logprobs, (other, best, other))


def test_stage0_refuses_scores_other_than_the_step_asked_for():
    """A final stage that answers a scoring step without its scores (or with tokens it
    did not sample) fails that step: stage 0 never hands a request a short echo."""
    async def main():
        pipe, _, host = await _split(frozenset())
        host.sampler.finalize_isolated = lambda *a, **k: Finalized((5,), 0, 0)
        res = await pipe.run([Step(GOOD, 0, _tok(1, 2), n_logits=1, sampling=Sampling(top_logprobs=0),
                                   score=(4,))])
        await host.close()
        await pipe.close()
        return res

    (res,) = asyncio.run(main())
    assert isinstance(res, StepFailedError) and "others than the step asked for" in str(res)


def test_a_scored_token_past_the_vocabulary_fails_its_session_alone():
    async def main():
        pipe, _, host = await _split(frozenset())
        res = await pipe.run([Step(GOOD, 0, _tok(1, 2), n_logits=2, sampling=Sampling(top_logprobs=0),
                                   score=(N_VOCAB,)),
                              Step(OTHER, 0, _tok(1))])
        await host.close()
        await pipe.close()
        return res

    bad, good = asyncio.run(main())
    assert isinstance(bad, StepFailedError) and "vocabulary" in str(bad)
    assert good == Finalized((truth(0),), 0, 0)
