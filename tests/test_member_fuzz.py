"""Fuzzing from an authenticated member (issue #17): hypothesis-generated malformed,
oversized and out-of-order wire messages into the sans-IO stage-control machines and
into a stage host (fake engine with real KV semantics, see test_member_security).

Every message goes through ``encode``/``decode`` first (what a member can put on the
wire is what the codec accepts), and raw byte strings go through a ``FrameDecoder``.
The properties: nothing raises, every answer can be encoded, the machines stay in a
valid state, and a victim session served beside the garbage gets exactly the tokens it
gets alone. The same with a real authenticated link and real llama.cpp stages is
tests/test_member_attacks.py::test_fuzzed_member_traffic_leaves_serving_unchanged (slow).
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshnode import wire
from meshnode.mesh.planner import Plan, PlannedStage
from meshnode.mesh.stage_control import ClaimLease, LoadParams, StageControlError, Timeouts
from meshnode.mesh.stage_control_coordinator import CoordinatorControl, CoordinatorState
from meshnode.mesh.stage_control_server import StageServerControl
from meshnode.mesh.stage_host import StageHost, StageRoute
from meshnode.state import StageState
from meshnode.wire import FrameDecoder, WireError, decode, encode
from meshnode.wire.errors import ProtocolError
from test_member_security import LIMITS, N_EMBD, VICTIM, Fabric, KVEngine, Worker, settle, victim_run

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHA = "ab" * 32
NODES = st.sampled_from(["c", "s1", "s2", "mallory", ""])

u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
small = st.integers(0, 40) | u32
term = st.integers(0, 6) | u64
text = st.text(max_size=12) | st.just("x" * 5000)
sha = st.sampled_from([SHA, "cd" * 32, ""])


@st.composite
def control_messages(draw) -> wire.Message:
    a, b = sorted(draw(st.lists(st.integers(0, 40), min_size=2, max_size=2)))
    kind = draw(st.sampled_from(["claim", "prepare", "inventory", "load", "stop", "status", "ready",
                                 "error", "trim", "end", "token"]))
    ref, t = draw(small), draw(term)
    match kind:
        case "claim":
            return wire.Claim(ref, t, draw(NODES), draw(sha), draw(small))
        case "prepare":
            return wire.Prepare(ref, t, draw(sha), draw(text), a, b, draw(small))
        case "inventory":
            return wire.Inventory(ref, t, draw(sha), a, b, draw(st.booleans()),
                                  draw(st.floats(allow_nan=True)), draw(text))
        case "load":
            return wire.Load(ref, t, draw(sha), a, b, draw(NODES), draw(NODES), draw(NODES),
                             draw(st.sampled_from(["f32", "f16"])), draw(small), draw(small), draw(small))
        case "stop":
            return wire.Stop(ref, t, draw(text))
        case "status":
            return wire.Status(ref, t, draw(st.sampled_from(wire.StageStatus)), draw(text),
                               draw(st.floats(allow_nan=True)))
        case "ready":
            return wire.Ready(ref, t, draw(small), draw(small), draw(st.floats(allow_nan=True)))
        case "error":
            return wire.Error(ref, draw(st.sampled_from(wire.ErrorCode)), draw(text))
        case "trim":
            return wire.Trim(ref, draw(u64), draw(u32))
        case "end":
            return wire.SessionEnd(ref, draw(u64))
        case _:
            return wire.TokenReturn(ref, draw(u64), ())


def _wire(msg: wire.Message) -> wire.Message | None:
    """What arrives when a member sends ``msg`` (None: the codec refuses it)."""
    try:
        return decode(encode(msg))
    except (ProtocolError, ValueError, OverflowError):
        return None


def _check_out(out) -> None:
    for dst, msg in out:
        assert isinstance(dst, str)
        decode(encode(msg))   # every answer can be sent


@FUZZ
@given(st.lists(st.tuples(NODES, control_messages(), st.floats(0, 2000), st.integers(0, 5)), max_size=40))
def test_stage_server_control_survives_any_member_traffic(script):
    """Random requests from random senders, out of order, with the host's commands mixed
    in where they are legal: never raises, always answers with encodable messages, the
    lease timer is finite, a READY stage is only left by its own coordinator."""
    srv = StageServerControl("s1", 0.0, lease=ClaimLease(claim=30.0, load=600.0))
    now = 0.0
    for sender, msg, dt, host in script:
        now += dt
        msg = _wire(msg)
        if msg is not None:
            before = (srv.state, srv.coordinator_id)
            srv.receive(sender, msg, now)
            if before[0] is StageState.READY and srv.state is not StageState.READY:
                assert sender == before[1] or isinstance(msg, wire.Claim) and sender == before[1]
        srv.handle_timer(now)
        t = srv.get_timer()
        assert t is None or math.isfinite(t)
        try:   # the host's own commands, legal or not (illegal ones raise StageControlError)
            if host == 1:
                srv.slice_present(LIMITS, now)
            elif host == 2:
                srv.loaded(N_EMBD, 1.0)
            elif host == 3:
                srv.slice_failed("disk full")
            elif host == 4:
                srv.load_failed("no memory")
        except StageControlError:
            pass
        _check_out(srv.messages_to_send())
        while srv.next_event() is not None:
            pass
        assert srv.state is None or isinstance(srv.state, StageState)


PLAN = Plan((PlannedStage("c", "coord", 0, 10, 1), PlannedStage("s1", "one", 10, 20, 1),
             PlannedStage("s2", "two", 20, 30, 1)), "fuzz")


@FUZZ
@given(st.lists(st.tuples(NODES, control_messages(), st.floats(0, 50)), max_size=40))
def test_coordinator_control_survives_any_member_traffic(script):
    """Forged replies (Status, Inventory, Ready, Error) from stages and strangers: the
    coordinator never raises, and a stranger cannot make the plan ready."""
    coord = CoordinatorControl(PLAN, term=3, model_sha256=SHA, model_name="m", n_layers=30,
                               load=LoadParams(512, 64, 2), now=0.0, timeouts=Timeouts())
    now = 0.0
    for sender, msg, dt in script:
        now += dt
        msg = _wire(msg)
        if msg is not None:
            coord.receive(sender, msg, now)
        coord.handle_timer(now)
        _check_out(coord.messages_to_send())
        while coord.next_event() is not None:
            pass
        if coord.state is CoordinatorState.READY:
            raise AssertionError("stage 0 never reported ready: the plan cannot be READY")


@st.composite
def data_messages(draw) -> wire.Message:
    kind = draw(st.sampled_from(["forward", "forward", "forward", "trim", "end"]))
    session = draw(st.sampled_from([1, 2, 3, VICTIM]) | u64)
    if kind == "trim":
        return wire.Trim(0, session, draw(small))
    if kind == "end":
        return wire.SessionEnd(0, session)
    segs, rows = [], 0
    for _ in range(draw(st.integers(0, 3))):
        n = draw(st.integers(0, 4))
        drafts = tuple(draw(st.lists(st.integers(0, 2**32 - 1), max_size=3)))
        segs.append(wire.Segment(
            session=draw(st.sampled_from([session, 1, 2, VICTIM]) | u64), pos=draw(st.integers(0, 12) | u32),
            n_rows=n, n_logits=draw(st.integers(0, n)), drafts=drafts,
            temperature=draw(st.floats(width=32)), top_k=draw(st.integers(-(2**31), 2**31 - 1)),
            top_p=draw(st.floats(width=32)), seed=draw(u64), flags=draw(st.integers(0, 255))))
        rows += n
    width = draw(st.sampled_from([N_EMBD, N_EMBD, 1, 9]))
    act = np.asarray(draw(st.lists(st.floats(width=32), min_size=rows * width, max_size=rows * width)),
                     dtype=np.float32).reshape(rows, width)
    return wire.Forward(0, draw(u64), draw(u32), tuple(segs), act)


def _raw_frames(raw: bytes) -> list:
    out = FrameDecoder().feed(raw)
    return [m for m in out if not isinstance(m, WireError)]


def _reference(n: int) -> list[int]:
    async def main():
        fabric = Fabric()
        host = StageHost(fabric, Worker(KVEngine()), StageRoute("coord", None, "f32", "up"))
        await victim_run(host, n)
        await host.close()
        return fabric.tokens(VICTIM)
    return asyncio.run(main())


REFERENCE = _reference(5)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["up", "coord", "mallory"]), data_messages() | st.binary(max_size=64)),
                max_size=30))
def test_stage_host_survives_fuzzed_data_and_the_victim_is_unchanged(script):
    """Malformed, oversized and out-of-order data messages: from a stranger they touch
    nothing; from the upstream itself (sessions other than the victim's) they may fail
    their own batches, never the stage or the victim."""
    async def main():
        fabric = Fabric()
        host = StageHost(fabric, Worker(KVEngine()), StageRoute("coord", None, "f32", "up"))
        items = iter(script)

        async def between(i):
            for _ in range(len(script) // 5 + 1):
                item = next(items, None)
                if item is None:
                    return
                sender, msg = item
                msgs = _raw_frames(msg) if isinstance(msg, bytes) else [_wire(msg)]
                for m in msgs:
                    if m is None:
                        continue
                    if sender != "mallory" and _touches_victim(m):
                        continue   # the upstream may end or rewind its own sessions
                    host.accept(sender, m)
                await settle(host)

        await victim_run(host, 5, between)
        alive = not host._task.done()   # noqa: SLF001
        await host.close()
        return fabric.tokens(VICTIM), alive

    tokens, alive = asyncio.run(main())
    assert alive
    assert tokens == REFERENCE


def _touches_victim(m: wire.Message) -> bool:
    if isinstance(m, wire.Forward):
        return any(s.session == VICTIM for s in m.segments)
    return getattr(m, "session", None) == VICTIM
