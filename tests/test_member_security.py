"""What an authenticated member may do to a stage it does not feed (issue #17, findings 3
and 4): pure logic with a fake engine and a fake fabric, a fake clock for the claim
lease. The same attacks over real QUIC with real llama.cpp stages are in
tests/test_member_attacks.py (slow).

* Finding 3: a stage host computes Forward only from the upstream its Load named (Trim
  and SessionEnd also from the coordinator); stage 0 takes TokenReturn only from the
  final stage; the stage queue is bounded; session ids are random 64-bit.
* Finding 4: Load parameters are checked against the trained context and the memory
  budget; a claim has a lease; the slice cache has a quota with LRU eviction.
"""

from __future__ import annotations

import asyncio
import os
import types

import numpy as np
import pytest

from meshnode import wire
from meshnode.engine import EngineInputError
from meshnode.mesh import stage_host as stage_host_mod
from meshnode.mesh.pipeline import MeshPipeline, _Waiting
from meshnode.mesh.stage_control import (
    ClaimLease,
    LoadLimits,
    LoadParams,
    LoadRequested,
    StopRequested,
    check_load,
)
from meshnode.mesh.stage_control_server import StageServerControl
from meshnode.mesh.stage_host import StageHost, StageRoute
from meshnode.state import StageState
from meshnode.wire import Claim, Error, ErrorCode, Inventory, Load, Prepare, Status, StageStatus

N_EMBD, N_VOCAB = 4, 97
SHA = "cd" * 32


# ---- a final stage with real KV semantics ----------------------------------------------


class KVEngine:
    """Final-stage stand-in that keeps each session's rows by position (rewinding like
    llama.cpp with ``rewind=True``, refusing gaps like the real engine); the greedy token
    of a row is a hash of the session's whole history up to it, so anything that touches
    a session's KV changes its tokens."""

    def __init__(self) -> None:
        self.kv: dict[int, list[float]] = {}
        self.calls = 0

    def next_pos(self, session: int) -> int:
        return len(self.kv.get(session, ()))

    def forward(self, segs, rewind=False):
        seen = set()
        for s in segs:
            if s.session in seen:
                raise EngineInputError(f"session {s.session} twice")
            seen.add(s.session)
            if s.pos > len(self.kv.get(s.session, ())):
                raise EngineInputError(f"session {s.session}: gap at {s.pos}")
            if s.hidden.shape[1:] != (N_EMBD,):
                raise EngineInputError("bad width")
        self.calls += 1
        out = []
        for s in segs:
            hist = self.kv.setdefault(s.session, [])
            del hist[s.pos:]
            hist.extend(float(x) for x in np.asarray(s.hidden[:, 0], dtype=np.float64))
            logits = np.zeros((s.n_logits, N_VOCAB), dtype=np.float32)
            for j in range(s.n_logits):
                upto = len(hist) - s.n_logits + j + 1
                logits[j, hash(tuple(hist[:upto])) % N_VOCAB] = 1.0
            out.append(logits)
        return out


class Worker:
    def __init__(self, engine, gate: asyncio.Event | None = None) -> None:
        self.engine = engine
        self.gate = gate

    async def step(self, rows, fn, *args):
        if self.gate is not None:
            await self.gate.wait()
        return fn(*args)

    # an ungated worker runs steps inline, so fast-lane frames take StageHost._forward_now
    def runs_inline(self, rows) -> bool:
        return self.gate is None

    def run_inline(self, rows, fn, *args):
        return fn(*args)

    async def drop(self, session):
        self.engine.kv.pop(session, None)

    async def rollback(self, session, pos):
        hist = self.engine.kv.get(session)
        if hist is not None:
            del hist[pos:]

    async def close(self): ...


class Fabric:
    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    async def send_data(self, node, msg, key) -> None:
        self.sent.append((node, msg))

    def send_lane(self, node, msg) -> bool:
        return False

    def tokens(self, session: int) -> list[int]:
        return [r.tokens[-1] for _, m in self.sent if isinstance(m, wire.TokenReturn)
                for r in m.results if r.session == session]


def step(batch_id: int, session: int, pos: int, rows: int = 1, value: float = 1.0) -> wire.Forward:
    seg = wire.Segment(session=session, pos=pos, n_rows=rows, n_logits=1, drafts=(),
                       temperature=0.0, top_k=0, top_p=1.0, seed=0, flags=0)
    act = np.full((rows, N_EMBD), value, dtype=np.float32)
    act[:, 0] = value + np.arange(rows)
    return wire.Forward(ref=0, batch_id=batch_id, step=0, segments=(seg,), act=act)


VICTIM = 0x5EED_5EED_5EED_5EED


async def settle(host: StageHost) -> None:
    for _ in range(200):
        if host._queue.empty():   # noqa: SLF001
            break
        await asyncio.sleep(0)
    await asyncio.sleep(0)


async def victim_run(host: StageHost, n: int, between=None) -> None:
    """The victim's 8-row prefill then ``n`` decode steps from the upstream "up";
    ``between(i)`` runs after each of its steps (the attack)."""
    host.accept("up", step(1, VICTIM, 0, rows=8, value=10.0))
    await settle(host)
    for i in range(n):
        if between is not None:
            await between(i)
            await settle(host)
        host.accept("up", step(2 + i, VICTIM, 8 + i, value=float(i)))
        await settle(host)


def run_victim(n: int, between_factory=None) -> tuple[list[int], StageHost, Fabric]:
    async def main():
        fabric = Fabric()
        host = StageHost(fabric, Worker(KVEngine()), StageRoute("coord", None, "f32", "up"))
        between = between_factory(host) if between_factory is not None else None
        await victim_run(host, n, between)
        await host.close()
        return fabric.tokens(VICTIM), host, fabric

    return asyncio.run(main())


def test_forward_trim_and_end_from_a_member_that_is_not_upstream_are_dropped():
    """The attack of finding 3: a member sends Forward(position 0, huge batch id), Trim
    and SessionEnd for the victim's session to the victim's stage."""
    reference, _, _ = run_victim(6)

    def attack(host):
        async def between(i):
            host.accept("mallory", step(2**63, VICTIM, 0, rows=3, value=-5.0))
            host.accept("mallory", wire.Trim(ref=0, session=VICTIM, pos=1))
            if i == 3:
                host.accept("mallory", wire.SessionEnd(ref=0, session=VICTIM))
        return between

    got, host, fabric = run_victim(6, attack)
    assert got == reference and len(got) == 7
    assert host.refused == 6 * 2 + 1
    # nothing was answered to the attacker, and no DataError reached the coordinator
    assert {node for node, _ in fabric.sent} == {"coord"}
    assert not [m for _, m in fabric.sent if isinstance(m, wire.DataError)]


def test_session_end_from_the_coordinator_is_taken_on_a_later_stage():
    """Stage 0 ends a session on every stage directly, so a stage 2 (upstream: stage 1)
    takes SessionEnd from the coordinator too; Forward only from its upstream."""
    async def main():
        fabric = Fabric()
        host = StageHost(fabric, Worker(KVEngine()), StageRoute("coord", None, "f32", "stage1"))
        host.accept("coord", step(1, 5, 0))          # not from upstream: dropped
        host.accept("stage1", step(1, 6, 0))
        await settle(host)
        host.accept("coord", wire.SessionEnd(ref=0, session=6))
        await settle(host)
        await host.close()
        return host, fabric

    host, fabric = asyncio.run(main())
    assert host.refused == 1 and host.sessions == set()
    assert [type(m).__name__ for _, m in fabric.sent] == ["TokenReturn"]


def test_without_the_check_the_attack_corrupts_the_victim(monkeypatch):
    """The same attack with every peer allowed (the code before the fix): the victim's
    tokens change, so the test above does detect the attack."""
    reference, _, _ = run_victim(6)
    monkeypatch.setattr(StageRoute, "source", property(lambda self: "mallory"))

    def attack(host):
        async def between(i):
            host.accept("mallory", step(2**63, VICTIM, 0, rows=3, value=-5.0))
        return between

    async def main():
        fabric = Fabric()
        host = StageHost(fabric, Worker(KVEngine()), StageRoute("coord", None, "f32", "up"))
        # with "mallory" as the source, the victim's own steps must come from it too
        orig = host.accept
        host.accept = lambda peer, msg: orig("mallory", msg)
        await victim_run(host, 6, attack(host))
        await host.close()
        return fabric.tokens(VICTIM)

    assert asyncio.run(main()) != reference


def test_stage_queue_is_bounded_under_a_burst(monkeypatch):
    monkeypatch.setattr(stage_host_mod, "QUEUE_MAX_FRAMES", 16)
    monkeypatch.setattr(stage_host_mod, "QUEUE_MAX_BYTES", 64 * 1024)

    async def main():
        gate = asyncio.Event()
        fabric = Fabric()
        host = StageHost(fabric, Worker(KVEngine(), gate), StageRoute("coord", None, "f32", "up"))
        peak_frames = peak_bytes = 0
        for i in range(2000):   # the engine is stuck: nothing leaves the queue
            host.accept("up", step(1 + i, 1000 + i, 0, rows=64))   # 1 KiB of activations each
            peak_frames = max(peak_frames, host._queue.qsize())   # noqa: SLF001
            peak_bytes = max(peak_bytes, host._queued_bytes)      # noqa: SLF001
        # bytes bind first: 64 frames of 1 KiB would fit, 16 frames is the count bound
        await asyncio.sleep(0.01)
        busy = [m for _, m in fabric.sent if isinstance(m, wire.DataError)]
        gate.set()
        await settle(host)
        # the stage still serves
        host.accept("up", step(9999, VICTIM, 0))
        await settle(host)
        await host.close()
        return peak_frames, peak_bytes, busy, host, fabric

    peak_frames, peak_bytes, busy, host, fabric = asyncio.run(main())
    assert peak_frames <= 16 and peak_bytes <= 64 * 1024
    assert host.refused == 2000 - 16 and len(busy) == 2000 - 16
    assert all(m.code is ErrorCode.BUSY for m in busy)
    assert fabric.tokens(VICTIM) and host._queued_bytes == 0   # noqa: SLF001


def test_token_return_only_from_the_final_stage():
    async def main():
        pipe = MeshPipeline(types.SimpleNamespace(), types.SimpleNamespace(), ["s1", "s2"])
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        pipe._pending[7] = _Waiting(fut, frozenset({1}), frozenset({1}))   # noqa: SLF001
        forged = wire.TokenReturn(ref=0, batch_id=7, results=(wire.SegmentResult(1, (666,), 0, 0),))
        real = wire.TokenReturn(ref=0, batch_id=7, results=(wire.SegmentResult(1, (42,), 0, 0),))
        assert pipe.on_data("s1", forged) and not fut.done()        # a middle stage
        assert pipe.on_data("mallory", forged) and not fut.done()   # not a stage at all
        assert pipe.on_data("mallory", wire.DataError(0, 7, 1, ErrorCode.BUSY, "x")) and not fut.done()
        assert pipe.on_data("s2", real) and fut.result() is real
        fut2 = loop.create_future()
        pipe._pending[8] = _Waiting(fut2, frozenset({1}), frozenset({1}))   # noqa: SLF001
        pipe.on_data("s1", wire.DataError(0, 8, 0, ErrorCode.ENGINE_ERROR, "boom"))   # a stage may fail a batch
        assert fut2.done() and fut2.exception() is not None
        return pipe.refused

    assert asyncio.run(main()) == 3


def test_session_ids_are_random_64_bit():
    from meshnode.serve.request import new_session_id

    in_use: set[int] = set()
    ids = [new_session_id(in_use) for _ in range(2000)]
    assert len(set(ids)) == 2000 and 0 not in ids
    assert max(ids) > 2**60 and all(0 < i < 2**64 for i in ids)
    # not sequential: consecutive ids are far apart
    assert sum(abs(a - b) < 2**32 for a, b in zip(ids, ids[1:])) == 0


# ---- Load parameters (finding 4) ----------------------------------------------------


LIMITS = LoadLimits(n_ctx_train=8192, budget_bytes=4 * 1024**3, weights_bytes=300 * 1024**2,
                    kv_bytes_per_cell=15 * 768, n_embd=576, n_head=9, n_vocab=49152,
                    overhead_bytes=64 * 1024**2)


def test_check_load_refuses_with_the_reason():
    assert check_load(LoadParams(2048, 256, 4), LIMITS) == ""
    assert "trained context of 8192" in check_load(LoadParams(100_000, 256, 1), LIMITS)
    msg = check_load(LoadParams(8192, 4096, 200), LIMITS, "node-b")
    assert "on node-b" in msg and "memory budget of 4.00 GiB" in msg
    assert "limit of 256 sequences" in check_load(LoadParams(512, 64, 10_000), LIMITS)
    assert ">= 1" in check_load(LoadParams(0, 64, 1), None)
    assert check_load(LoadParams(4_000_000, 64, 1), None) == ""   # no limits measured: structure only
    assert check_load(LoadParams(8192, 512, 4), LoadLimits(n_ctx_train=8192)) == ""


def _claimed(lease: ClaimLease = ClaimLease(), now: float = 0.0) -> StageServerControl:
    srv = StageServerControl("s1", now, lease=lease)
    srv.receive("c", Claim(1, 5, "c", SHA, 1), now)
    srv.receive("c", Prepare(2, 5, SHA, "m", 10, 20, 30), now)
    srv.messages_to_send()
    return srv


def _load(ref: int = 3, n_ctx: int = 2048, n_batch: int = 256, n_seq_max: int = 4,
          upstream: str = "c", coordinator: str = "c") -> Load:
    return Load(ref, 5, SHA, 10, 20, upstream, "", coordinator, "f32", n_ctx, n_batch, n_seq_max)


@pytest.mark.parametrize("load, words", [
    (_load(n_ctx=1_000_000), "trained context of 8192"),
    (_load(n_ctx=8192, n_seq_max=256, n_batch=4096), "over its memory budget"),
    (_load(n_seq_max=2**31), "limit of 256"),
    (_load(upstream=""), "another node upstream"),
    (_load(coordinator="x"), "as coordinator"),
    (_load(upstream="s1"), "another node upstream"),
])
def test_a_load_over_the_limits_is_refused_before_any_engine(load, words):
    srv = _claimed()
    srv.slice_present(LIMITS, 0.0)
    srv.messages_to_send()
    srv.receive("c", load, 1.0)
    [(dst, msg)] = srv.messages_to_send()
    assert dst == "c" and isinstance(msg, Error) and msg.code is ErrorCode.BAD_FIELD and words in msg.message
    assert srv.state is StageState.PREPARING
    assert not any(isinstance(e, LoadRequested) for e in iter(srv.next_event, None))
    # a load within the limits goes on
    srv.receive("c", _load(ref=9), 2.0)
    assert srv.state is StageState.LOADING
    assert [e for e in iter(srv.next_event, None) if isinstance(e, LoadRequested)][0].upstream == "c"


# ---- claim lease ------------------------------------------------------------------------


def test_a_claim_without_prepare_expires_and_frees_the_stage():
    srv = StageServerControl("s1", 0.0, lease=ClaimLease(claim=30.0, load=600.0))
    srv.receive("mallory", Claim(1, 2**64 - 1, "mallory", SHA, 1), 0.0)   # the highest term there is
    srv.messages_to_send()
    assert srv.state is StageState.ASSIGNED and srv.get_timer() == 30.0
    srv.handle_timer(29.9)
    assert srv.state is StageState.ASSIGNED
    srv.handle_timer(30.0)
    assert srv.state is StageState.STOPPED and srv.get_timer() is None
    assert any(isinstance(e, StopRequested) for e in iter(srv.next_event, None))
    [(dst, msg)] = srv.messages_to_send()
    assert dst == "mallory" and isinstance(msg, Status) and msg.state is StageStatus.FAILED
    assert "lease expired" in msg.detail
    # the lapsed claim fences nobody: an honest coordinator with a low term claims
    srv.receive("honest", Claim(2, 3, "honest", SHA, 1), 31.0)
    [(_, msg)] = srv.messages_to_send()
    assert isinstance(msg, Status) and msg.state is StageStatus.CLAIMED
    assert srv.coordinator_id == "honest" and srv.state is StageState.ASSIGNED
    # ... while the lapsed claimant itself needs a higher term
    srv2 = StageServerControl("s2", 0.0, lease=ClaimLease(claim=1.0))
    srv2.receive("m", Claim(1, 9, "m", SHA, 1), 0.0)
    srv2.handle_timer(1.0)
    srv2.messages_to_send()
    srv2.receive("m", Claim(2, 9, "m", SHA, 1), 2.0)
    [(_, msg)] = srv2.messages_to_send()
    assert isinstance(msg, Error) and msg.code is ErrorCode.FENCED


def test_inventory_polls_renew_the_lease_and_a_present_slice_waits_for_load():
    srv = _claimed(ClaimLease(claim=30.0, load=600.0))
    for t in range(1, 200):   # the coordinator polls while the slice is prepared
        srv.receive("c", Inventory(10 + t, 5, SHA, 10, 20, False, 0.0, ""), float(t))
        srv.handle_timer(float(t))
    assert srv.state is StageState.PREPARING and srv.get_timer() == 199.0 + 30.0
    srv.slice_present(LIMITS, 200.0)
    assert srv.get_timer() == 800.0
    srv.handle_timer(799.0)
    assert srv.state is StageState.PREPARING
    srv.handle_timer(800.0)
    assert srv.state is StageState.STOPPED and "no Load" in srv.detail


def test_a_loaded_stage_has_no_lease():
    srv = _claimed(ClaimLease(claim=30.0, load=600.0))
    srv.slice_present(LIMITS, 1.0)
    srv.receive("c", _load(), 2.0)
    assert srv.get_timer() is None
    srv.loaded(576, 1.0)
    srv.handle_timer(10_000.0)
    assert srv.state is StageState.READY


# ---- slice cache quota --------------------------------------------------------------------


def test_slice_cache_quota_evicts_least_recently_used_never_pinned(tmp_path, synthetic_gguf):
    from meshnode.models.index import ModelRef
    from meshnode.models.slicer import SliceCache, unpin
    from meshnode.paths import NodePaths

    path = synthetic_gguf(n_layer=8, n_embd=64, n_head=4, n_kv_head=4, n_ff=128)
    model = ModelRef("tiny", path, "ab" * 32, 8, "llama")
    paths = NodePaths.resolve(tmp_path / "home").ensure()
    probe = SliceCache(paths, quota=2**40)
    size = probe.get(model, 2, 4).stat().st_size   # a middle slice of 2 layers
    probe.evict()
    cache = SliceCache(paths, quota=int(size * 2.5))
    a = cache.get(model, 2, 4)
    b = cache.get(model, 4, 6, pin=True)
    os.utime(a.with_suffix(".json"), ns=(1, 1))
    os.utime(b.with_suffix(".json"), ns=(2, 2))   # b is older than what comes next
    c = cache.get(model, 1, 3)                    # three middles > 2.5 slices: evict one
    assert c.is_file() and b.is_file() and not a.exists() and not a.with_suffix(".json").exists()
    a = cache.get(model, 2, 4)                    # rebuilt; b pinned, so c (LRU) goes
    assert a.is_file() and b.is_file() and not c.exists()
    unpin(b)
    os.utime(b.with_suffix(".json"), ns=(1, 1))
    c = cache.get(model, 1, 3)                    # b unpinned and least recently used: it goes
    assert not b.exists() and a.is_file() and c.is_file()
    # a slice larger than the whole quota is still returned (and kept while it is newest)
    tiny = SliceCache(paths, quota=1)
    d = tiny.get(model, 5, 7)
    assert d.is_file() and not a.exists() and not c.exists()
