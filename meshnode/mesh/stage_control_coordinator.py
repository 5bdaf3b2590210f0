"""Stage control, coordinator side: the sans-IO machine that negotiates one plan.

Theory of operation. :class:`CoordinatorControl` runs on the coordinator (stage 0) for
one :class:`Plan`. Construction queues a Claim for every remote stage; a claimed stage
is sent Prepare and its Inventory polled until the slice is present; then it is sent
Load. Stage 0 is the host's own: the machine asks for it at once with
:class:`~meshnode.mesh.stage_control.LocalLoadRequested`, answered with
:meth:`CoordinatorControl.local_stage_ready`. The loads overlap: nothing flows along
the route before every stage is READY (PlanReady), so no stage waits for the ones after
it, and a re-plan whose stages load in 0.1 s each is ready in 0.1 s, not 0.3. Any failure (an Error answer, a missed
deadline, a lost link, an unsolicited failure report) fails the whole plan and sends
Stop to every remote stage.

No socket, no clock: the caller feeds ``receive()`` / ``handle_timer(now)`` and drains
``messages_to_send()``, ``next_event()`` and ``get_timer()`` (see
:mod:`meshnode.mesh.stage_control` for the parameters and events).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from meshnode.mesh.planner import Plan
from meshnode.mesh.stage_control import (
    CoordinatorEvent,
    MachineOutput,
    LoadParams,
    LocalLoadRequested,
    PlanFailed,
    PlanReady,
    StageControlError,
    Timeouts,
)
from meshnode.state import StageChanged, StageInfo, StageState
from meshnode.wire import (
    Claim,
    Error,
    Inventory,
    Load,
    Message,
    Prepare,
    Ready,
    StageStatus,
    Status,
    Stop,
)

__all__ = ["CoordinatorControl", "CoordinatorState"]

log = logging.getLogger(__name__)

# ---- transition tables ----------------------------------------------------------
#
# Rules (read these before changing a table):
#
# Coordinator, per stage (_Phase). A remote stage goes CLAIMING -> PREPARING (claim
# acknowledged, Prepare sent, Inventory polled) -> PREPARED (slice present) -> LOADING
# (Load sent, as soon as PREPARED) -> READY. The coordinator's own stage 0 starts in
# WAITING and goes LOADING at once (its host builds the slice, then loads), then READY.
# Any phase may go to FAILED (error answer, timeout, unsolicited failure report) or
# STOPPED (stop() or another stage's failure). FAILED may only become STOPPED (stop()).
#
# Coordinator, whole plan (CoordinatorState): NEGOTIATING -> READY when every stage is
# READY; any stage failing makes it FAILED (once; Stop is then sent to every remote
# stage); stop() makes it STOPPED from anywhere. STOPPED is final.

class _Phase(enum.Enum):
    WAITING = "waiting"        # stage 0 only: before its load is asked for (at once)
    CLAIMING = "claiming"
    PREPARING = "preparing"
    PREPARED = "prepared"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


_END = {_Phase.FAILED, _Phase.STOPPED}
_PHASE_TRANSITIONS: dict[_Phase, frozenset[_Phase]] = {
    _Phase.WAITING: frozenset({_Phase.LOADING, *_END}),
    _Phase.CLAIMING: frozenset({_Phase.PREPARING, *_END}),
    _Phase.PREPARING: frozenset({_Phase.PREPARED, *_END}),
    _Phase.PREPARED: frozenset({_Phase.LOADING, *_END}),
    _Phase.LOADING: frozenset({_Phase.READY, *_END}),
    _Phase.READY: frozenset(_END),
    _Phase.FAILED: frozenset({_Phase.STOPPED}),
    _Phase.STOPPED: frozenset(),
}
_PHASE_TO_STATE = {
    _Phase.WAITING: StageState.ASSIGNED,
    _Phase.CLAIMING: StageState.ASSIGNED,
    _Phase.PREPARING: StageState.PREPARING,
    _Phase.PREPARED: StageState.PREPARING,
    _Phase.LOADING: StageState.LOADING,
    _Phase.READY: StageState.READY,
    _Phase.FAILED: StageState.FAILED,
    _Phase.STOPPED: StageState.STOPPED,
}


class CoordinatorState(enum.Enum):
    NEGOTIATING = "negotiating"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


_COORD_TRANSITIONS: dict[CoordinatorState, frozenset[CoordinatorState]] = {
    CoordinatorState.NEGOTIATING: frozenset(
        {CoordinatorState.READY, CoordinatorState.FAILED, CoordinatorState.STOPPED}),
    CoordinatorState.READY: frozenset({CoordinatorState.FAILED, CoordinatorState.STOPPED}),
    CoordinatorState.FAILED: frozenset({CoordinatorState.STOPPED}),
    CoordinatorState.STOPPED: frozenset(),
}


# ---- the machine ------------------------------------------------------------------


@dataclass(slots=True)
class _Stage:
    index: int
    node_id: str
    name: str
    start: int
    end: int
    phase: _Phase
    detail: str = ""
    refs: set[int] = field(default_factory=set)
    deadline: float | None = None
    next_poll: float | None = None

    def info(self) -> StageInfo:
        return StageInfo(self.index, self.node_id, self.name, self.start, self.end,
                         _PHASE_TO_STATE[self.phase], self.detail)


class CoordinatorControl(MachineOutput[CoordinatorEvent]):
    """The coordinator's side of stage negotiation for one plan.

    Construction starts the negotiation: Claims are queued for every remote stage (or,
    for a one-stage plan, :class:`LocalLoadRequested` is queued at once). ``term`` must
    be higher than any term this coordinator used before (fencing).
    """

    def __init__(
        self,
        plan: Plan,
        *,
        term: int,
        model_sha256: str,
        model_name: str,
        n_layers: int,
        load: LoadParams,
        now: float,
        timeouts: Timeouts = Timeouts(),
    ) -> None:
        if not plan.stages or plan.stages[0].start != 0 or plan.stages[-1].end != n_layers:
            raise ValueError(f"plan does not cover layers 0:{n_layers}")
        super().__init__()
        self.term = term
        self.model_sha256 = model_sha256
        self.model_name = model_name
        self.n_layers = n_layers
        self.params = load
        self.timeouts = timeouts
        self.state = CoordinatorState.NEGOTIATING
        self._stages = [
            _Stage(i, s.node_id, s.name, s.start, s.end, _Phase.WAITING if i == 0 else _Phase.CLAIMING)
            for i, s in enumerate(plan.stages)
        ]
        self._by_node = {s.node_id: s for s in self._stages[1:]}
        self._next_ref = 0
        self._n_embd: int | None = None
        for st in self._stages:
            self._events.append(StageChanged(st.info()))
        for st in self._stages[1:]:
            ref = self._ref()
            st.refs = {ref}
            st.deadline = now + timeouts.claim
            self._send(st, Claim(ref, term, self._stages[0].node_id, model_sha256, st.index))
        self._advance(now)

    # -- public: reading

    @property
    def stages(self) -> tuple[StageInfo, ...]:
        """Every stage as the UI and ``meshnode status --json`` show it."""
        return tuple(s.info() for s in self._stages)

    def get_timer(self) -> float | None:
        """When ``handle_timer`` must be called next (None: no timer)."""
        times = [t for s in self._stages for t in (s.deadline, s.next_poll) if t is not None]
        return min(times) if times else None

    # -- public: feeding

    def handle_timer(self, now: float) -> None:
        """Fire due Inventory polls and deadlines (a missed deadline fails the plan)."""
        for st in self._stages:
            if self.state is not CoordinatorState.NEGOTIATING and self.state is not CoordinatorState.READY:
                return
            if st.deadline is not None and now >= st.deadline:
                self._fail(st, self._timeout_reason(st), now)
                return
            if st.next_poll is not None and now >= st.next_poll:
                ref = self._ref()
                st.refs.add(ref)
                st.next_poll = now + self.timeouts.poll
                self._send(st, Inventory(ref, self.term, self.model_sha256, st.start, st.end, False, 0.0, ""))

    def receive(self, node_id: str, msg: Message, now: float) -> None:
        """Feed a control message that ``node_id`` sent to this coordinator."""
        st = self._by_node.get(node_id)
        if st is None or self.state in (CoordinatorState.FAILED, CoordinatorState.STOPPED):
            log.debug("coordinator ignores %s from %s", type(msg).__name__, node_id)
            return
        if isinstance(msg, Error):
            if msg.ref in st.refs:
                self._fail(st, f"{msg.code.name.lower()}: {msg.message}", now)
            return
        if getattr(msg, "term", None) != self.term:
            log.debug("coordinator ignores %r from %s: term is not %d", msg, node_id, self.term)
            return
        solicited = msg.ref in st.refs
        match msg:
            case Status(state=StageStatus.CLAIMED) if solicited and st.phase is _Phase.CLAIMING:
                ref = self._ref()
                st.refs = {ref}
                st.deadline = now + self.timeouts.inventory
                st.next_poll = now + self.timeouts.poll
                self._set_phase(st, _Phase.PREPARING, "preparing slice")
                self._send(st, Prepare(ref, self.term, self.model_sha256, self.model_name,
                                       st.start, st.end, self.n_layers))
            case Status(state=StageStatus.FAILED) if solicited or msg.ref == 0:
                self._fail(st, msg.detail or "failed", now)
            case Inventory() if (solicited or msg.ref == 0) and st.phase is _Phase.PREPARING:
                if (msg.model_sha256, msg.layer_start, msg.layer_end) != (self.model_sha256, st.start, st.end):
                    self._fail(st, f"reported slice {msg.layer_start}:{msg.layer_end} of another request", now)
                elif msg.present:
                    st.refs, st.deadline, st.next_poll = set(), None, None
                    self._set_phase(st, _Phase.PREPARED, "slice present")
                    self._advance(now)
                else:
                    detail = f"slice {msg.progress:.0%}" + (f": {msg.detail}" if msg.detail else "")
                    if detail != st.detail:
                        st.detail = detail
                        self._events.append(StageChanged(st.info()))
            case Ready() if solicited and st.phase is _Phase.LOADING:
                if self._n_embd is not None and msg.n_embd != self._n_embd:
                    self._fail(st, f"n_embd {msg.n_embd} differs from the other stages' {self._n_embd}", now)
                    return
                self._n_embd = msg.n_embd
                st.refs, st.deadline = set(), None
                self._set_phase(st, _Phase.READY, f"loaded in {msg.load_ms:.0f} ms")
                self._advance(now)
            case _:
                log.debug("coordinator ignores %r from %s in %s", msg, node_id, st.phase.value)

    # -- public: commands

    def local_stage_ready(self, n_embd: int, load_ms: float, now: float) -> bool:
        """The host loaded stage 0. Returns False when the plan was stopped or failed
        meanwhile (the host must then free what it loaded). Raises
        :class:`StageControlError` when stage 0 was not asked to load."""
        st = self._stages[0]
        if st.phase in _END:
            return False
        if st.phase is not _Phase.LOADING:
            raise StageControlError(f"local_stage_ready() while stage 0 is {st.phase.value}")
        if self._n_embd is not None and n_embd != self._n_embd:
            self._fail(st, f"n_embd {n_embd} differs from the other stages' {self._n_embd}", now)
            return False
        st.deadline = None
        self._set_phase(st, _Phase.READY, f"loaded in {load_ms:.0f} ms")
        self._advance(now)
        return True

    def local_stage_failed(self, reason: str, now: float) -> None:
        """The host could not load stage 0: the plan fails (Stop goes to every stage)."""
        st = self._stages[0]
        if st.phase not in _END:
            self._fail(st, reason, now)

    def stage_lost(self, node_id: str, reason: str, now: float) -> None:
        """The link to a remote stage's node went down: that stage FAILED, the plan fails
        as for a failure report (no-op for other nodes or a plan already ended)."""
        st = self._by_node.get(node_id)
        if st is None or st.phase in _END or self.state in (CoordinatorState.FAILED, CoordinatorState.STOPPED):
            return
        self._fail(st, reason, now)

    def stop(self, reason: str) -> None:
        """Send Stop to every remote stage and mark all stages STOPPED (idempotent)."""
        if self.state is CoordinatorState.STOPPED:
            return
        for st in self._stages:
            if st.index > 0 and st.phase is not _Phase.STOPPED:
                self._send(st, Stop(self._ref(), self.term, reason))
            st.refs, st.deadline, st.next_poll = set(), None, None
            if st.phase is not _Phase.STOPPED:
                self._set_phase(st, _Phase.STOPPED, reason)
        self._set_state(CoordinatorState.STOPPED)

    # -- internals

    def _ref(self) -> int:
        self._next_ref = self._next_ref % 0xFFFFFFFF + 1   # u32, never 0 (0 = unsolicited)
        return self._next_ref

    def _send(self, st: _Stage, msg: Message) -> None:
        self._out.append((st.node_id, msg))

    def _set_phase(self, st: _Stage, phase: _Phase, detail: str = "") -> None:
        if phase not in _PHASE_TRANSITIONS[st.phase]:
            raise StageControlError(f"stage {st.index}: {st.phase.value} -> {phase.value} is not allowed")
        log.info("stage %d (%s) [%d,%d): %s -> %s %s", st.index, st.name, st.start, st.end,
                 st.phase.value, phase.value, detail)
        st.phase, st.detail = phase, detail
        self._events.append(StageChanged(st.info()))

    def _set_state(self, state: CoordinatorState) -> None:
        if state not in _COORD_TRANSITIONS[self.state]:
            raise StageControlError(f"plan: {self.state.value} -> {state.value} is not allowed")
        log.info("plan (term %d): %s -> %s", self.term, self.state.value, state.value)
        self.state = state

    def _advance(self, now: float) -> None:
        """Load every stage that can load, or report the plan ready once all are.

        A remote stage loads once its slice is present, stage 0 at once (its host builds
        its slice first, hence its deadline covers both). Nothing flows along the route
        before PlanReady, so no stage needs the ones after it loaded first: the loads
        overlap, and a plan is ready after its slowest load, not their sum."""
        if self.state is not CoordinatorState.NEGOTIATING:
            return
        if all(st.phase is _Phase.READY for st in self._stages):
            self._set_state(CoordinatorState.READY)
            self._events.append(PlanReady(self.stages))
            return
        for j, st in enumerate(self._stages):
            down = self._stages[j + 1].node_id if j + 1 < len(self._stages) else ""
            if j == 0 and st.phase is _Phase.WAITING:
                st.deadline = now + self.timeouts.inventory + self.timeouts.load
                self._set_phase(st, _Phase.LOADING, "loading")
                self._events.append(LocalLoadRequested(self.model_sha256, st.start, st.end, down, self.params))
            elif j > 0 and st.phase is _Phase.PREPARED:
                ref = self._ref()
                st.refs, st.deadline = {ref}, now + self.timeouts.load
                self._set_phase(st, _Phase.LOADING, "loading")
                p = self.params
                self._send(st, Load(ref, self.term, self.model_sha256, st.start, st.end,
                                    self._stages[j - 1].node_id, down, self._stages[0].node_id,
                                    p.wire_dtype, p.n_ctx, p.n_batch, p.n_seq_max, p.kv_type))

    def _timeout_reason(self, st: _Stage) -> str:
        what = {
            _Phase.CLAIMING: f"no answer to Claim within {self.timeouts.claim:g} s",
            _Phase.PREPARING: f"slice not present within {self.timeouts.inventory:g} s ({st.detail})",
            _Phase.LOADING: f"not ready within {self.timeouts.load:g} s of Load",
        }
        return what.get(st.phase, "timed out")

    def _fail(self, st: _Stage, reason: str, now: float) -> None:
        full = f"stage {st.index} ({st.name}): {reason}"
        st.refs, st.deadline, st.next_poll = set(), None, None
        self._set_phase(st, _Phase.FAILED, reason)
        for other in self._stages:
            if other.index > 0 and other.phase is not _Phase.STOPPED:
                # The failed stage gets Stop too: it may still hold memory (a timed-out load).
                self._send(other, Stop(self._ref(), self.term, f"plan failed: {full}"))
            if other is not st and other.phase not in _END:
                other.refs, other.deadline, other.next_poll = set(), None, None
                self._set_phase(other, _Phase.STOPPED, "plan failed")
        self._set_state(CoordinatorState.FAILED)
        self._events.append(PlanFailed(full, st.index))
