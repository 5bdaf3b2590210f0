"""Stage control: a coordinator and stage servers wired together in memory, fake clock."""

from __future__ import annotations

import pytest

from meshnode.mesh.planner import Plan, PlannedStage
from meshnode.mesh.stage_control import (
    Claimed,
    LoadParams,
    LoadRequested,
    LocalLoadRequested,
    PlanFailed,
    PlanReady,
    PrepareRequested,
    StageControlError,
    StopRequested,
    Timeouts,
    stages_json,
)
from meshnode.mesh.stage_control_coordinator import CoordinatorControl, CoordinatorState
from meshnode.mesh.stage_control_server import StageServerControl
from meshnode.state import StageChanged, StageInfo, StageState
from meshnode.wire import Claim, Error, ErrorCode, Load, Prepare, Status, Stop, decode, encode

SHA = "ab" * 32
PLAN = Plan(
    (PlannedStage("c", "coord", 0, 10, 1), PlannedStage("s1", "one", 10, 20, 1), PlannedStage("s2", "two", 20, 30, 1)),
    "test",
)
PARAMS = LoadParams(n_ctx=2048, n_batch=256, n_seq_max=4, wire_dtype="f16")


class Mesh:
    """Delivers queued messages between in-memory cores; records the trace."""

    def __init__(self, plan: Plan = PLAN, term: int = 1, timeouts: Timeouts = Timeouts()):
        self.now = 100.0
        self.servers = {s.node_id: StageServerControl(s.node_id, self.now, name=s.name) for s in plan.stages[1:]}
        self.coord = CoordinatorControl(plan, term=term, model_sha256=SHA, model_name="m", n_layers=30,
                                        load=PARAMS, now=self.now, timeouts=timeouts)
        self.trace: list[tuple[str, str, str]] = []
        self.coord_events: list = []
        self.server_events: dict[str, list] = {k: [] for k in self.servers}
        self.coord_id = plan.stages[0].node_id

    def pump(self) -> None:
        moved = True
        while moved:
            moved = False
            for dst, msg in self.coord.messages_to_send():
                moved = True
                msg = decode(encode(msg))  # everything must survive the wire
                self.trace.append((self.coord_id, dst, type(msg).__name__))
                if dst in self.servers:
                    self.servers[dst].receive(self.coord_id, msg, self.now)
            for sid, srv in self.servers.items():
                for dst, msg in srv.messages_to_send():
                    moved = True
                    msg = decode(encode(msg))
                    self.trace.append((sid, dst, type(msg).__name__))
                    if dst == self.coord_id:
                        self.coord.receive(sid, msg, self.now)
        while (ev := self.coord.next_event()) is not None:
            self.coord_events.append(ev)
        for sid, srv in self.servers.items():
            while (ev := srv.next_event()) is not None:
                self.server_events[sid].append(ev)

    def advance(self, dt: float) -> None:
        """Move the clock, firing every timer that falls due on the way."""
        end = self.now + dt
        while (t := self.coord.get_timer()) is not None and t <= end:
            self.now = max(self.now, t)
            self.coord.handle_timer(self.now)
            self.pump()
        self.now = end

    def events_of(self, kind, sid: str | None = None) -> list:
        evs = self.coord_events if sid is None else self.server_events[sid]
        return [e for e in evs if isinstance(e, kind)]


def bring_up(mesh: Mesh) -> None:
    """Drive hosts through the happy path."""
    mesh.pump()
    for srv in mesh.servers.values():
        assert srv.slice_present()
    mesh.pump()
    for sid in ("s2", "s1"):
        assert mesh.servers[sid].state is StageState.LOADING
        mesh.servers[sid].loaded(576, 12.0)
        mesh.pump()
    assert mesh.coord.local_stage_ready(576, 3.0, mesh.now)
    mesh.pump()


def test_happy_path_event_sequence():
    mesh = Mesh()
    mesh.pump()
    assert mesh.server_events["s1"][:4] == [
        StageChanged(StageInfo(1, "s1", "one", 0, 0, StageState.ASSIGNED, "claimed by c")),
        Claimed("c", 1, 1, SHA),
        StageChanged(StageInfo(1, "s1", "one", 10, 20, StageState.PREPARING, "preparing slice")),
        PrepareRequested(SHA, "m", 10, 20, 30),
    ]
    assert mesh.events_of(PrepareRequested, "s1") == [PrepareRequested(SHA, "m", 10, 20, 30)]
    assert [s.state for s in mesh.coord.stages] == [StageState.LOADING, StageState.PREPARING, StageState.PREPARING]

    # progress is polled every 0.5 s and shown
    mesh.servers["s1"].slice_progress(0.4, "slicing")
    mesh.advance(0.5)
    assert mesh.coord.stages[1].detail == "slice 40%: slicing"
    assert mesh.coord.get_timer() == mesh.now + 0.5

    bring_up(mesh)
    assert mesh.coord.state is CoordinatorState.READY
    ready = mesh.events_of(PlanReady)
    assert len(ready) == 1
    assert [s.state for s in ready[0].stages] == [StageState.READY] * 3
    assert mesh.coord.get_timer() is None
    load = mesh.events_of(LoadRequested, "s1")[0]
    assert load == LoadRequested(SHA, 1, 10, 20, "c", "s2", "c", PARAMS)
    assert mesh.events_of(LoadRequested, "s2")[0].downstream == ""
    assert mesh.events_of(LocalLoadRequested) == [LocalLoadRequested(SHA, 0, 10, "s1", PARAMS)]
    # the coordinator's stage-state history per stage
    history = {}
    for e in mesh.events_of(StageChanged):
        history.setdefault(e.stage.index, []).append(e.stage.state)
    S = StageState
    assert history[0] == [S.ASSIGNED, S.LOADING, S.READY]
    assert history[1][0] == S.ASSIGNED and history[1][-2:] == [S.LOADING, S.READY]
    assert [type(e).__name__ for e in mesh.server_events["s1"]][4:] == [
        "StageChanged", "StageChanged", "LoadRequested", "StageChanged"]
    assert mesh.servers["s1"].stage.state is StageState.READY
    assert stages_json(mesh.coord.stages)[1] == {
        "index": 1, "node_id": "s1", "node": "one", "layers": [10, 20], "state": "ready",
        "detail": "loaded in 12 ms",
    }


def test_message_order_claim_prepare_inventory_load_ready():
    mesh = Mesh()
    bring_up(mesh)
    s1 = [k for src, dst, k in mesh.trace if "s1" in (src, dst)]
    assert s1[:4] == ["Claim", "Status", "Prepare", "Inventory"]
    assert s1[-2:] == ["Load", "Ready"]


def test_stages_load_as_soon_as_they_can_and_the_plan_waits_for_all():
    mesh = Mesh()
    mesh.pump()
    # stage 0 at once: its host builds its slice and loads it while the others prepare
    assert mesh.events_of(LocalLoadRequested) == [LocalLoadRequested(SHA, 0, 10, "s1", PARAMS)]
    assert mesh.coord.stages[0].state is StageState.LOADING
    mesh.servers["s1"].slice_present()   # s1 loads without waiting for s2
    mesh.pump()
    assert mesh.servers["s1"].state is StageState.LOADING
    assert mesh.servers["s2"].state is StageState.PREPARING
    mesh.servers["s1"].loaded(576, 1.0)
    assert mesh.coord.local_stage_ready(576, 1.0, mesh.now)
    mesh.pump()
    assert mesh.coord.state is CoordinatorState.NEGOTIATING and not mesh.events_of(PlanReady)
    mesh.servers["s2"].slice_present()
    mesh.pump()
    assert mesh.servers["s2"].state is StageState.LOADING
    mesh.servers["s2"].loaded(576, 1.0)
    mesh.pump()
    assert mesh.coord.state is CoordinatorState.READY and len(mesh.events_of(PlanReady)) == 1
    loads = [dst for src, dst, k in mesh.trace if k == "Load"]
    assert loads == ["s1", "s2"]


def test_stage0_deadline_covers_its_slice_and_load():
    mesh = Mesh(timeouts=Timeouts(inventory=10.0, load=5.0))
    mesh.pump()
    for srv in mesh.servers.values():
        srv.slice_present()
    mesh.pump()
    for srv in mesh.servers.values():
        srv.loaded(576, 1.0)
    mesh.pump()
    mesh.advance(14.0)
    assert mesh.coord.state is CoordinatorState.NEGOTIATING
    mesh.advance(1.5)
    assert mesh.coord.state is CoordinatorState.FAILED
    assert "stage 0" in mesh.events_of(PlanFailed)[0].reason


def test_single_stage_plan_loads_locally_at_once():
    plan = Plan((PlannedStage("c", "coord", 0, 30, 1),), "alone")
    mesh = Mesh(plan)
    mesh.pump()
    assert mesh.trace == []
    assert mesh.events_of(LocalLoadRequested) == [LocalLoadRequested(SHA, 0, 30, "", PARAMS)]
    mesh.coord.local_stage_ready(576, 5.0, mesh.now)
    mesh.pump()
    assert mesh.events_of(PlanReady)


def test_claim_timeout_fails_plan_and_stops_others():
    mesh = Mesh(timeouts=Timeouts(claim=5.0))
    # s2 never answers: drop everything sent to it
    mesh.servers.pop("s2")
    mesh.pump()
    mesh.advance(4.9)
    assert mesh.coord.state is CoordinatorState.NEGOTIATING
    mesh.advance(0.2)
    assert mesh.coord.state is CoordinatorState.FAILED
    failed = mesh.events_of(PlanFailed)
    assert failed == [PlanFailed("stage 2 (two): no answer to Claim within 5 s", 2)]
    assert mesh.servers["s1"].state is StageState.STOPPED
    assert mesh.events_of(StopRequested, "s1")
    assert [s.state for s in mesh.coord.stages] == [StageState.STOPPED, StageState.STOPPED, StageState.FAILED]
    assert mesh.coord.get_timer() is None


def test_inventory_deadline_and_load_timeout():
    mesh = Mesh(timeouts=Timeouts(inventory=3.0, poll=0.5))
    mesh.pump()
    mesh.servers["s1"].slice_present()
    mesh.servers["s2"].slice_progress(0.1)
    mesh.advance(3.1)
    assert mesh.events_of(PlanFailed)[0].reason.startswith("stage 2 (two): slice not present within 3 s")

    mesh = Mesh(timeouts=Timeouts(load=10.0))
    mesh.pump()
    for srv in mesh.servers.values():
        srv.slice_present()
    mesh.pump()
    mesh.servers["s1"].loaded(576, 1.0)
    mesh.pump()
    mesh.advance(10.0)
    assert mesh.events_of(PlanFailed) == [PlanFailed("stage 2 (two): not ready within 10 s of Load", 2)]
    # the stage that timed out loading gets Stop too; a late loaded() is then refused
    assert mesh.servers["s2"].state is StageState.STOPPED
    assert mesh.servers["s2"].loaded(576, 1.0) is False


def test_load_failure_is_reported():
    mesh = Mesh()
    mesh.pump()
    for srv in mesh.servers.values():
        srv.slice_present()
    mesh.pump()
    mesh.servers["s2"].load_failed("out of memory")
    mesh.pump()
    assert mesh.events_of(PlanFailed) == [PlanFailed("stage 2 (two): engine_error: out of memory", 2)]
    assert mesh.servers["s1"].state is StageState.STOPPED


def test_stop_releases_every_stage():
    mesh = Mesh()
    bring_up(mesh)
    mesh.coord.stop("user asked")
    mesh.pump()
    assert mesh.coord.state is CoordinatorState.STOPPED
    assert all(s.state is StageState.STOPPED for s in mesh.coord.stages)
    for sid in mesh.servers:
        assert mesh.events_of(StopRequested, sid) == [StopRequested("user asked")]
        assert mesh.servers[sid].state is StageState.STOPPED
    mesh.coord.stop("again")   # idempotent
    mesh.pump()
    assert [k for _, _, k in mesh.trace].count("Stop") == 2


# ---- fencing -----------------------------------------------------------------------


def claim(srv: StageServerControl, coordinator: str, term: int, ref: int = 77):
    srv.receive(coordinator, Claim(ref, term, coordinator, SHA, 1), 0.0)
    return srv.messages_to_send()


@pytest.mark.parametrize("term", [1, 0])
def test_second_coordinator_with_same_or_lower_term_is_fenced(term):
    mesh = Mesh(term=1)
    bring_up(mesh)
    out = claim(mesh.servers["s1"], "intruder", term)
    assert len(out) == 1
    dst, msg = out[0]
    assert dst == "intruder" and isinstance(msg, Error) and msg.code is ErrorCode.FENCED and msg.ref == 77
    assert mesh.servers["s1"].state is StageState.READY


def test_second_coordinator_with_higher_term_while_serving_is_busy():
    mesh = Mesh(term=1)
    bring_up(mesh)
    [(_, msg)] = claim(mesh.servers["s1"], "intruder", 5)
    assert isinstance(msg, Error) and msg.code is ErrorCode.BUSY
    assert mesh.servers["s1"].coordinator_id == "c"


def test_higher_term_after_stop_is_accepted_lower_is_not():
    mesh = Mesh(term=3)
    bring_up(mesh)
    mesh.coord.stop("done")
    mesh.pump()
    srv = mesh.servers["s1"]
    [(_, msg)] = claim(srv, "other", 3)
    assert isinstance(msg, Error) and msg.code is ErrorCode.FENCED
    [(_, msg)] = claim(srv, "other", 4)
    assert isinstance(msg, Status) and msg.state == "claimed" and msg.term == 4
    assert srv.state is StageState.ASSIGNED and srv.coordinator_id == "other"


def test_stale_term_messages_are_fenced():
    srv = StageServerControl("s1", 0.0)
    claim(srv, "c", 2)
    srv.receive("c", Prepare(5, 1, SHA, "m", 0, 10, 30), 0.0)
    [(_, msg)] = srv.messages_to_send()
    assert isinstance(msg, Error) and msg.code is ErrorCode.FENCED and msg.ref == 5
    srv.receive("c", Stop(6, 1, "old"), 0.0)
    [(_, msg)] = srv.messages_to_send()
    assert msg.code is ErrorCode.FENCED and srv.state is StageState.ASSIGNED
    # a message from a node that did not claim is fenced even with the right term
    srv.receive("x", Prepare(7, 2, SHA, "m", 0, 10, 30), 0.0)
    [(_, msg)] = srv.messages_to_send()
    assert msg.code is ErrorCode.FENCED


def test_coordinator_fails_when_fenced():
    mesh = Mesh(term=1)
    # s1 already serves another coordinator at term 9
    claim(mesh.servers["s1"], "other", 9)
    mesh.pump()
    failed = mesh.events_of(PlanFailed)
    assert len(failed) == 1 and failed[0].stage_index == 1 and "fenced" in failed[0].reason
    assert mesh.servers["s1"].coordinator_id == "other"
    assert mesh.servers["s1"].state is StageState.ASSIGNED   # the failed plan's Stop was fenced too


def test_same_coordinator_restarted_with_higher_term_supersedes():
    srv = StageServerControl("s1", 0.0)
    claim(srv, "c", 1)
    srv.receive("c", Prepare(2, 1, SHA, "m", 0, 10, 30), 0.0)
    srv.messages_to_send()
    [(_, msg)] = claim(srv, "c", 2)
    assert isinstance(msg, Status) and msg.term == 2
    evs = []
    while (e := srv.next_event()) is not None:
        evs.append(e)
    assert StopRequested("superseded by term 2") in evs
    assert srv.state is StageState.ASSIGNED and srv.term == 2


# ---- misuse and odd requests -------------------------------------------------------------


def test_host_misuse_raises_local_protocol_error():
    srv = StageServerControl("s1", 0.0)
    with pytest.raises(StageControlError):
        srv.slice_present()
    claim(srv, "c", 1)
    with pytest.raises(StageControlError):
        srv.loaded(576, 1.0)
    mesh = Mesh()
    assert mesh.coord.local_stage_ready(576, 1.0, mesh.now)
    with pytest.raises(StageControlError):   # twice
        mesh.coord.local_stage_ready(576, 1.0, mesh.now)


def test_load_before_slice_present_is_busy():
    srv = StageServerControl("s1", 0.0)
    claim(srv, "c", 1)
    srv.receive("c", Prepare(2, 1, SHA, "m", 10, 20, 30), 0.0)
    srv.messages_to_send()
    srv.receive("c", Load(3, 1, SHA, 10, 20, "c", "", "c", "f32", 2048, 512, 1), 0.0)
    [(_, msg)] = srv.messages_to_send()
    assert isinstance(msg, Error) and msg.code is ErrorCode.BUSY
    assert srv.state is StageState.PREPARING


def test_claim_must_come_from_the_named_coordinator():
    srv = StageServerControl("s1", 0.0)
    srv.receive("x", Claim(1, 1, "c", SHA, 1), 0.0)
    [(_, msg)] = srv.messages_to_send()
    assert isinstance(msg, Error) and msg.code is ErrorCode.BAD_FIELD and srv.state is None


def test_ready_stage_failure_reaches_coordinator():
    mesh = Mesh()
    bring_up(mesh)
    mesh.servers["s2"].fail("engine crashed")
    mesh.pump()
    assert mesh.events_of(PlanFailed) == [PlanFailed("stage 2 (two): engine crashed", 2)]
    assert mesh.servers["s1"].state is StageState.STOPPED
