"""StageHost's data plane on a final stage (pure logic: fake engine, fake fabric).

The final stage skips a lone window that starts past its session's verified positions
(a lookahead whose guess it has already seen fail) and answers DataError at once;
every legitimate step starts at or before that position and is computed.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from meshnode import wire
from meshnode.mesh.stage_host import StageHost, StageRoute

N_EMBD, N_VOCAB = 4, 256


class _Engine:
    """Final-stage stand-in: the greedy choice for the row at position p is ``truth[p]``."""

    def __init__(self, truth: dict[int, int]) -> None:
        self.truth = truth
        self.calls: list[tuple[int, int]] = []   # (pos, rows)

    def next_pos(self, session: int) -> int:
        return 1 << 30   # positions are not tracked: no step is a gap here

    def forward(self, segs, rewind=False):
        out = []
        for s in segs:
            self.calls.append((s.pos, s.n_rows))
            logits = np.zeros((s.n_logits, N_VOCAB), dtype=np.float32)
            first = s.pos + s.n_rows - s.n_logits
            for j in range(s.n_logits):
                logits[j, self.truth.get(first + j, 0)] = 1.0
            out.append(logits)
        return out


class _Worker:
    """``inline``: whether steps run on the caller's thread (EngineWorker.runs_inline),
    which lets the host compute a fast-lane step inside accept()."""

    def __init__(self, engine: _Engine, inline: bool = False) -> None:
        self.engine = engine
        self.inline = inline

    async def step(self, rows, fn, *args):
        return fn(*args)

    def runs_inline(self, rows) -> bool:
        return self.inline

    def run_inline(self, rows, fn, *args):
        return fn(*args)

    async def drop(self, session): ...

    async def rollback(self, session, pos): ...

    async def close(self): ...


class _Fabric:
    def __init__(self, lane: bool = False) -> None:
        self.sent: list[object] = []
        self.lane = lane
        self.on_lane: list[object] = []

    async def send_data(self, node, msg, key) -> None:
        self.sent.append(msg)

    def send_lane(self, node, msg) -> bool:
        if self.lane:
            self.sent.append(msg)
            self.on_lane.append(msg)
        return self.lane


def _window(batch_id: int, pos: int, drafts: tuple[int, ...], session: int = 1, flags: int = 0) -> wire.Forward:
    rows = len(drafts) + 1
    seg = wire.Segment(session=session, pos=pos, n_rows=rows, n_logits=rows, drafts=drafts,
                       temperature=0.0, top_k=0, top_p=1.0, seed=0, flags=flags)
    return wire.Forward(ref=0, batch_id=batch_id, step=0, segments=(seg,),
                        act=np.zeros((rows, N_EMBD), dtype=np.float32))


def test_final_stage_skips_only_windows_past_the_verified_positions():
    # the true token at position p is 100 + p
    engine = _Engine({p: 101 + p for p in range(64)})

    async def main():
        fabric = _Fabric()
        host = StageHost(fabric, _Worker(engine), StageRoute(coordinator="c", downstream=None))
        # W at 10 = [last, d1..d3]: d1 right (111), d2 wrong -> 1 accepted, bonus 112
        await host._forward(_window(1, 10, (111, 5, 6)))
        # its lookahead at 14 builds on rejected rows: skipped, answered at once
        await host._forward(_window(2, 14, (7, 8)))
        # the real next window starts at 12: computed
        await host._forward(_window(3, 12, (113, 114)))
        # fully accepted (next free position 15): a lookahead exactly there is computed
        await host._forward(_window(4, 15, (116,)))
        # a session the stage has not verified anything of yet is never skipped
        await host._forward(_window(5, 30, (131,), session=2))
        await host.close()
        return fabric.sent, host.skipped

    sent, skipped = asyncio.run(main())
    assert engine.calls == [(10, 4), (12, 3), (15, 2), (30, 2)]
    assert skipped == 1
    kinds = [(type(m).__name__, m.batch_id) for m in sent]
    assert kinds == [("TokenReturn", 1), ("DataError", 2), ("TokenReturn", 3),
                     ("TokenReturn", 4), ("TokenReturn", 5)]
    first = sent[0].results[0]
    assert (first.tokens, first.n_accepted) == ((111, 112), 1)
    assert sent[2].results[0].tokens == (113, 114, 115)


def test_a_copy_older_than_the_newest_batch_of_its_session_is_not_computed():
    """A lane step resent over the stream may arrive after its session moved on (the
    lane copy got through late): computing it would rewind the session past newer rows."""
    engine = _Engine({p: 101 + p for p in range(64)})

    async def main():
        fabric = _Fabric(lane=True)
        host = StageHost(fabric, _Worker(engine), StageRoute(coordinator="c", downstream=None))
        await host._forward(_window(1, 10, (), flags=wire.SEG_LANE))
        await host._forward(_window(1, 10, ()))          # the same step again: recomputed
        await host._forward(_window(2, 11, (), flags=wire.SEG_LANE))
        await host._forward(_window(1, 10, ()))          # late copy of batch 1: dropped
        await host._forward(_window(1, 10, (), session=2))   # another session: its own history
        await host.close()
        return fabric

    fabric = asyncio.run(main())
    assert engine.calls == [(10, 1), (10, 1), (11, 1), (10, 1)]
    kinds = [(type(m).__name__, m.batch_id) for m in fabric.sent]
    assert kinds == [("TokenReturn", 1), ("TokenReturn", 1), ("TokenReturn", 2), ("DataError", 1),
                     ("TokenReturn", 1)]
    assert "superseded" in fabric.sent[3].message
    # replies go on the lane exactly when stage 0 marked the step SEG_LANE
    assert [m.batch_id for m in fabric.on_lane] == [1, 2]


def test_a_step_arriving_after_its_session_ended_is_not_computed():
    """SessionEnd travels the stream, a decode step may travel the fast lane: a cancelled
    request's last step can arrive after the end and must not bring the session back."""
    engine = _Engine({p: 101 + p for p in range(64)})

    async def main():
        fabric = _Fabric(lane=True)
        host = StageHost(fabric, _Worker(engine), StageRoute(coordinator="c", downstream=None))
        host.accept("c", _window(1, 10, (), flags=wire.SEG_LANE))
        host.accept("c", wire.SessionEnd(ref=0, session=1))
        host.accept("c", _window(2, 11, (), flags=wire.SEG_LANE))   # overtaken by the end
        for _ in range(100):
            if len(fabric.sent) == 2:
                break
            await asyncio.sleep(0.01)
        sessions = set(host.sessions)
        await host.close()
        return fabric, sessions

    fabric, sessions = asyncio.run(main())
    assert engine.calls == [(10, 1)]
    assert [(type(m).__name__, m.batch_id) for m in fabric.sent] == [("TokenReturn", 1), ("DataError", 2)]
    assert fabric.sent[1].code == wire.ErrorCode.NO_SUCH_SESSION
    assert sessions == set()


def test_a_lane_step_is_computed_inside_accept_when_nothing_waits():
    """StageHost._forward_now: a fast-lane step that finds the stage idle (and a worker
    that runs it inline) is computed and answered before accept() returns; behind a
    queued message, or off the lane, it waits its turn in the queue."""
    engine = _Engine({p: 101 + p for p in range(64)})

    async def main():
        fabric = _Fabric(lane=True)
        host = StageHost(fabric, _Worker(engine, inline=True), StageRoute(coordinator="c", downstream=None))
        host.accept("c", _window(1, 10, (), flags=wire.SEG_LANE))
        at_once = (list(engine.calls), [(type(m).__name__, m.batch_id) for m in fabric.on_lane])
        host.accept("c", _window(2, 5, (), session=2))                 # off the lane: queued
        host.accept("c", _window(3, 11, (), flags=wire.SEG_LANE))    # behind it: queued too
        queued = list(engine.calls)
        for _ in range(100):
            if len(fabric.sent) == 3:
                break
            await asyncio.sleep(0.01)
        await host.close()
        return at_once, queued, fabric

    (calls, lane), queued, fabric = asyncio.run(main())
    assert calls == [(10, 1)] and lane == [("TokenReturn", 1)]
    assert queued == [(10, 1)]
    assert engine.calls == [(10, 1), (5, 1), (11, 1)]     # in the order they came
    assert [(type(m).__name__, m.batch_id) for m in fabric.sent] == [
        ("TokenReturn", 1), ("TokenReturn", 2), ("TokenReturn", 3)]
    assert fabric.sent[2].results[0].tokens == (112,)


def test_a_lane_step_that_fails_inside_accept_is_answered_and_the_stage_goes_on():
    """The engine raising in StageHost._forward_now fails that batch alone (DataError to
    the coordinator, from a task); the next lane step is computed as usual."""
    class _Failing(_Engine):
        def forward(self, segs, rewind=False):
            if segs[0].pos == 10:
                raise RuntimeError("boom")
            return super().forward(segs, rewind)

    engine = _Failing({p: 101 + p for p in range(64)})

    async def main():
        fabric = _Fabric(lane=True)
        host = StageHost(fabric, _Worker(engine, inline=True), StageRoute(coordinator="c", downstream=None))
        assert host.accept("c", _window(1, 10, (), flags=wire.SEG_LANE))
        host.accept("c", _window(2, 11, (), flags=wire.SEG_LANE))
        for _ in range(100):
            if len(fabric.sent) == 2:
                break
            await asyncio.sleep(0.01)
        await host.close()
        return fabric

    fabric = asyncio.run(main())
    sent = sorted(fabric.sent, key=lambda m: m.batch_id)
    assert [(type(m).__name__, m.batch_id) for m in sent] == [("DataError", 1), ("TokenReturn", 2)]
    assert sent[0].code == wire.ErrorCode.ENGINE_ERROR and "boom" in sent[0].message
    assert sent[1].results[0].tokens == (112,)


class _SessionWorker(_Worker):
    """Records what the host frees and copies, and what it had sent downstream by then."""

    def __init__(self, fabric: _Fabric) -> None:
        super().__init__(_Engine({}))
        self.fabric = fabric
        self.log: list[tuple[str, int, int]] = []   # (what, session, messages sent before it)

    async def drop(self, session):
        self.log.append(("drop", session, len(self.fabric.sent)))

    async def copy(self, src, dst, n_pos):
        self.log.append(("copy", dst, len(self.fabric.sent)))


@pytest.mark.parametrize("downstream", ["d", None])
def test_session_end_and_copy_are_relayed_in_order_after_they_are_done_here(downstream):
    """Stage 0 sends SessionEnd to stage 1 only; each stage frees the session, then
    passes the end on, behind everything before it and ahead of the next request's copy
    into the slot it freed (sent to every stage directly, the end could reach the last
    stage after a copy relayed there, which then found no slot: a failed request)."""

    async def main():
        fabric = _Fabric()
        worker = _SessionWorker(fabric)
        host = StageHost(fabric, worker, StageRoute(coordinator="c", downstream=downstream))
        host.accept("c", wire.SessionEnd(ref=0, session=1))
        host.accept("c", wire.SessionCopy(ref=0, src=2, dst=3, n_pos=38))
        host.accept("c", wire.SessionEnd(ref=0, session=1))   # ended twice: still relayed
        for _ in range(100):
            if len(worker.log) == 3 and (downstream is None or len(fabric.sent) == 3):
                break
            await asyncio.sleep(0.01)
        await host.close()
        return fabric.sent, worker.log

    sent, log = asyncio.run(main())
    assert [(what, s) for what, s, _ in log] == [("drop", 1), ("copy", 3), ("drop", 1)]
    if downstream is None:
        assert sent == []     # the final stage passes nothing on
        return
    assert [type(m).__name__ for m in sent] == ["SessionEnd", "SessionCopy", "SessionEnd"]
    # each relayed only after this stage did it
    assert [before for _, _, before in log] == [0, 1, 2]


class _MiddleEngine:
    """A middle stage with real position bookkeeping: hidden states out, a session holds
    the rows it was given, a copy into a full stage fails like the real engine's."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self.calls: list[tuple[int, ...]] = []

    def next_pos(self, session: int) -> int:
        return self.held.get(session, 0)

    def forward(self, segs, rewind=False):
        for s in segs:
            assert s.pos <= self.next_pos(s.session), "the host let a gap through"
        self.calls.append(tuple(s.session for s in segs))
        for s in segs:
            self.held[s.session] = s.pos + s.n_rows
        return [np.asarray(s.hidden) + 1.0 for s in segs]


class _FullWorker(_Worker):
    async def copy(self, src, dst, n_pos):
        from meshnode.engine import EngineBusyError
        raise EngineBusyError("all 4 session slots are in use")


def test_a_session_whose_kv_is_missing_fails_alone_and_says_why():
    """A step that starts past what its session holds here (its copy failed here) is left
    out of the batch and failed alone, with the copy's failure; the others go on."""
    GOOD, BAD = 1, 2

    async def main():
        fabric = _Fabric()
        engine = _MiddleEngine()
        host = StageHost(fabric, _FullWorker(engine), StageRoute(coordinator="c", downstream="d"))
        host.accept("c", wire.SessionCopy(ref=0, src=9, dst=BAD, n_pos=38))    # fails here
        segs = (wire.Segment(session=GOOD, pos=0, n_rows=2, n_logits=0, drafts=(), temperature=0.0,
                             top_k=0, top_p=1.0, seed=0, flags=0),
                wire.Segment(session=BAD, pos=38, n_rows=1, n_logits=0, drafts=(), temperature=0.0,
                             top_k=0, top_p=1.0, seed=0, flags=0))
        act = np.arange(3 * N_EMBD, dtype=np.float32).reshape(3, N_EMBD)
        host.accept("c", wire.Forward(ref=0, batch_id=5, step=0, segments=segs, act=act))
        for _ in range(100):
            if len(fabric.sent) == 3:
                break
            await asyncio.sleep(0.01)
        await host.close()
        return engine, fabric.sent, act

    engine, sent, act = asyncio.run(main())
    copy, err, fwd = sent
    assert isinstance(copy, wire.SessionCopy)                  # relayed even though it failed here
    assert isinstance(err, wire.DataError) and (err.batch_id, err.session) == (5, BAD)
    assert err.code == wire.ErrorCode.NO_SUCH_SESSION
    assert "position 38 given, this stage holds 0" in err.message and "all 4 session slots" in err.message
    assert engine.calls == [(GOOD,)]
    assert isinstance(fwd, wire.Forward) and [s.session for s in fwd.segments] == [GOOD]
    np.testing.assert_array_equal(fwd.act, act[:2] + 1.0)      # GOOD's rows, computed


def test_a_middle_stage_that_cannot_reach_the_next_fails_the_batch_at_once():
    """Without a link to the next stage's node, a Forward would be dropped and stage 0
    would wait out its reply timeout: the coordinator gets a DataError for the batch."""
    from meshnode.mesh.fabric import PeerUnavailableError

    class _Middle:
        def forward(self, segs, rewind=False):
            return [np.zeros((s.n_rows, N_EMBD), dtype=np.float32) for s in segs]

        def next_pos(self, session):
            return 1 << 30

    class _NoLinkToNext(_Fabric):
        async def send_data(self, node, msg, key) -> None:
            if node == "next":
                raise PeerUnavailableError("no authenticated link to peer next")
            self.sent.append((node, msg))

    async def main():
        fabric = _NoLinkToNext()
        host = StageHost(fabric, _Worker(_Middle()), StageRoute(coordinator="c", downstream="next"))
        await host._forward(_window(7, 10, ()))
        await host.close()
        return fabric.sent

    sent = asyncio.run(main())
    assert [(node, type(m).__name__, m.batch_id) for node, m in sent] == [("c", "DataError", 7)]
    assert "cannot reach the next stage's node next" in sent[0][1].message
