"""Stage control: the Claim -> Prepare -> Inventory -> Load -> Ready negotiation, sans-IO.

Theory of operation. Two state machines, neither touching a socket or a clock (the
aioquic / h11 pattern, see STYLE.md):

* :class:`CoordinatorControl` runs on the coordinator (stage 0) for one :class:`Plan`.
  It claims every remote stage, asks it to prepare its slice, polls its Inventory until
  the slice is present, then loads the stages *downstream first* (last stage first),
  each waiting for Ready before the upstream one is loaded; its own stage 0 is loaded
  last by the host (event :class:`LocalLoadRequested`, answered with
  :meth:`CoordinatorControl.local_stage_ready`).
* :class:`StageServerControl` runs on every node that may serve a stage. It answers
  the coordinator, enforces fencing by term, and asks its host to do the real work
  through events (:class:`PrepareRequested`, :class:`LoadRequested`,
  :class:`StopRequested`); the host reports back with commands (``slice_present()``,
  ``loaded()`` ...).

The caller feeds both with ``receive(node_id, msg, now)`` and ``handle_timer(now)``,
then drains ``messages_to_send()`` (``(node_id, message)`` pairs), ``next_event()``
and re-arms its timer from ``get_timer()``. Stage states as the UI sees them are
:class:`meshnode.state.StageState`; each change is published as
:class:`meshnode.state.StageChanged`.

Errors: misuse by the host (a command in the wrong state) raises
:class:`LocalProtocolError`; a peer's bad or stale request is answered with a wire
``Error`` (FENCED, BUSY, BAD_FIELD) and never raises.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from meshnode.mesh.planner import Plan
from meshnode.state import StageChanged, StageInfo, StageState
from meshnode.wire import (
    Claim,
    Error,
    ErrorCode,
    Inventory,
    Load,
    Message,
    Prepare,
    Ready,
    Status,
    Stop,
)
from meshnode.wire import LocalProtocolError as _WireLocalProtocolError

__all__ = [
    "Claimed",
    "CoordinatorControl",
    "CoordinatorState",
    "LoadParams",
    "LoadRequested",
    "LocalLoadRequested",
    "LocalProtocolError",
    "PlanFailed",
    "PlanReady",
    "PrepareRequested",
    "StageServerControl",
    "StopRequested",
    "Timeouts",
    "stages_json",
]

log = logging.getLogger(__name__)

# ---- transition tables ----------------------------------------------------------
#
# Rules (read these before changing a table):
#
# Coordinator, per stage (_Phase). A remote stage goes CLAIMING -> PREPARING (claim
# acknowledged, Prepare sent, Inventory polled) -> PREPARED (slice present) -> LOADING
# (Load sent; only once every downstream stage is READY) -> READY. The coordinator's own
# stage 0 waits in WAITING until stage 1 is READY, then LOADING -> READY via the host.
# Any phase may go to FAILED (error answer, timeout, unsolicited failure report) or
# STOPPED (stop() or another stage's failure). FAILED may only become STOPPED (stop()).
#
# Coordinator, whole plan (CoordinatorState): NEGOTIATING -> READY when every stage is
# READY; any stage failing makes it FAILED (once; Stop is then sent to every remote
# stage); stop() makes it STOPPED from anywhere. STOPPED is final.
#
# Stage server (StageState, None = idle). A Claim is accepted when idle, or when the
# stage is STOPPED/FAILED and the claim's term is higher than the current term, or from
# the *same* coordinator with a higher term (a restarted coordinator supersedes its own
# old assignment). A Claim from another coordinator while serving is refused: FENCED when
# its term <= current term, BUSY otherwise. Every later request must carry the current
# term and come from the claiming coordinator, else FENCED.

class _Phase(enum.Enum):
    WAITING = "waiting"        # stage 0 only: until the downstream stages are ready
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

_S = StageState
_SERVER_TRANSITIONS: dict[StageState | None, frozenset[StageState]] = {
    None: frozenset({_S.ASSIGNED}),
    _S.ASSIGNED: frozenset({_S.PREPARING, _S.FAILED, _S.STOPPED}),
    _S.PREPARING: frozenset({_S.PREPARING, _S.LOADING, _S.FAILED, _S.STOPPED}),
    _S.LOADING: frozenset({_S.READY, _S.FAILED, _S.STOPPED}),
    _S.READY: frozenset({_S.FAILED, _S.STOPPED}),
    _S.FAILED: frozenset({_S.ASSIGNED, _S.STOPPED}),
    _S.STOPPED: frozenset({_S.ASSIGNED}),
}
_SERVING = frozenset({_S.ASSIGNED, _S.PREPARING, _S.LOADING, _S.READY})


class LocalProtocolError(_WireLocalProtocolError):
    """The host used a state machine wrongly (a command in a state that forbids it)."""

    def __init__(self, detail: str) -> None:
        super().__init__(ErrorCode.INTERNAL, detail)


# ---- parameters and events ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadParams:
    """What every stage's engine is opened with (sent in Load)."""

    n_ctx: int
    n_batch: int = 512
    n_seq_max: int = 1
    wire_dtype: str = "f32"   # 'f32' | 'f16'


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds. ``inventory`` bounds the whole slice preparation (download, slicing)."""

    claim: float = 5.0
    inventory: float = 600.0
    poll: float = 0.5
    load: float = 300.0


@dataclass(frozen=True, slots=True)
class PlanReady:
    """Every stage is READY: the pipeline can serve."""

    stages: tuple[StageInfo, ...]


@dataclass(frozen=True, slots=True)
class PlanFailed:
    """Negotiation (or a ready stage) failed; Stop was sent to every remote stage."""

    reason: str
    stage_index: int | None = None


@dataclass(frozen=True, slots=True)
class LocalLoadRequested:
    """Coordinator host: load stage 0 now, then call ``local_stage_ready()``."""

    model_sha256: str
    layer_start: int
    layer_end: int
    downstream: str           # node id of stage 1, '' when the model runs here alone
    params: LoadParams


@dataclass(frozen=True, slots=True)
class Claimed:
    """Stage server: this node now belongs to ``coordinator_id`` for ``term``."""

    coordinator_id: str
    term: int
    stage_index: int
    model_sha256: str


@dataclass(frozen=True, slots=True)
class PrepareRequested:
    """Stage server host: make the slice present, report with ``slice_progress()`` /
    ``slice_present()`` / ``slice_failed()``."""

    model_sha256: str
    model_name: str
    layer_start: int
    layer_end: int
    n_layers_total: int


@dataclass(frozen=True, slots=True)
class LoadRequested:
    """Stage server host: open the engine, then ``loaded()`` or ``load_failed()``."""

    model_sha256: str
    stage_index: int
    layer_start: int
    layer_end: int
    upstream: str
    downstream: str
    coordinator: str
    params: LoadParams


@dataclass(frozen=True, slots=True)
class StopRequested:
    """Stage server host: free the engine and everything the stage holds."""

    reason: str


CoordinatorEvent = StageChanged | PlanReady | PlanFailed | LocalLoadRequested
ServerEvent = StageChanged | Claimed | PrepareRequested | LoadRequested | StopRequested


def stages_json(stages: tuple[StageInfo, ...] | list[StageInfo]) -> list[dict[str, Any]]:
    """The ``stages`` list of ``meshnode status --json``."""
    return [
        {
            "index": s.index,
            "node_id": s.node_id,
            "node": s.node_name,
            "layers": [s.layer_start, s.layer_end],
            "state": s.state.value,
            "detail": s.detail,
        }
        for s in stages
    ]


# ---- coordinator ------------------------------------------------------------------


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


class CoordinatorControl:
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
        self._out: list[tuple[str, Message]] = []
        self._events: deque[CoordinatorEvent] = deque()
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

    def messages_to_send(self) -> list[tuple[str, Message]]:
        """Drain the queued ``(node_id, message)`` pairs; send them in order."""
        out, self._out = self._out, []
        return out

    def next_event(self) -> CoordinatorEvent | None:
        """The next event, or None when there is none."""
        return self._events.popleft() if self._events else None

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
            case Status(state="claimed") if solicited and st.phase is _Phase.CLAIMING:
                ref = self._ref()
                st.refs = {ref}
                st.deadline = now + self.timeouts.inventory
                st.next_poll = now + self.timeouts.poll
                self._set_phase(st, _Phase.PREPARING, "preparing slice")
                self._send(st, Prepare(ref, self.term, self.model_sha256, self.model_name,
                                       st.start, st.end, self.n_layers))
            case Status(state="failed") if solicited or msg.ref == 0:
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
        :class:`LocalProtocolError` when stage 0 was not asked to load."""
        st = self._stages[0]
        if st.phase in _END:
            return False
        if st.phase is not _Phase.LOADING:
            raise LocalProtocolError(f"local_stage_ready() while stage 0 is {st.phase.value}")
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
            raise LocalProtocolError(f"stage {st.index}: {st.phase.value} -> {phase.value} is not allowed")
        log.info("stage %d (%s) [%d,%d): %s -> %s %s", st.index, st.name, st.start, st.end,
                 st.phase.value, phase.value, detail)
        st.phase, st.detail = phase, detail
        self._events.append(StageChanged(st.info()))

    def _set_state(self, state: CoordinatorState) -> None:
        if state not in _COORD_TRANSITIONS[self.state]:
            raise LocalProtocolError(f"plan: {self.state.value} -> {state.value} is not allowed")
        log.info("plan (term %d): %s -> %s", self.term, self.state.value, state.value)
        self.state = state

    def _advance(self, now: float) -> None:
        """Load the next stage (downstream first) or report the plan ready."""
        if self.state is not CoordinatorState.NEGOTIATING:
            return
        j = len(self._stages) - 1
        while j >= 0 and self._stages[j].phase is _Phase.READY:
            j -= 1
        if j < 0:
            self._set_state(CoordinatorState.READY)
            self._events.append(PlanReady(self.stages))
            return
        st = self._stages[j]
        down = self._stages[j + 1].node_id if j + 1 < len(self._stages) else ""
        if j == 0 and st.phase is _Phase.WAITING:
            st.deadline = now + self.timeouts.load
            self._set_phase(st, _Phase.LOADING, "loading")
            self._events.append(LocalLoadRequested(self.model_sha256, st.start, st.end, down, self.params))
        elif j > 0 and st.phase is _Phase.PREPARED:
            ref = self._ref()
            st.refs, st.deadline = {ref}, now + self.timeouts.load
            self._set_phase(st, _Phase.LOADING, "loading")
            p = self.params
            self._send(st, Load(ref, self.term, self.model_sha256, st.start, st.end,
                                self._stages[j - 1].node_id, down, self._stages[0].node_id,
                                p.wire_dtype, p.n_ctx, p.n_batch, p.n_seq_max))

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


# ---- stage server -------------------------------------------------------------------


class StageServerControl:
    """The serving side of stage negotiation on one node (at most one stage at a time).

    ``state`` is None while idle, else a :class:`StageState`. ``term`` is the highest
    term this node accepted; requests with another term are FENCED.
    """

    def __init__(self, node_id: str, now: float, *, name: str = "") -> None:
        self.node_id = node_id
        self.name = name or node_id
        self.state: StageState | None = None
        self.term = 0
        self.coordinator_id: str | None = None
        self.stage_index = 0
        self.model_sha256 = ""
        self.layer_start = 0
        self.layer_end = 0
        self.present = False
        self.progress = 0.0
        self.detail = ""
        self._load_ref = 0
        self._out: list[tuple[str, Message]] = []
        self._events: deque[ServerEvent] = deque()

    # -- public: reading

    @property
    def stage(self) -> StageInfo | None:
        """This node's stage as the UI shows it (None while idle)."""
        if self.state is None:
            return None
        return StageInfo(self.stage_index, self.node_id, self.name, self.layer_start, self.layer_end,
                         self.state, self.detail)

    def messages_to_send(self) -> list[tuple[str, Message]]:
        out, self._out = self._out, []
        return out

    def next_event(self) -> ServerEvent | None:
        return self._events.popleft() if self._events else None

    def get_timer(self) -> float | None:
        """The server keeps no timers (liveness of the coordinator is failover's job)."""
        return None

    def handle_timer(self, now: float) -> None:
        return None

    # -- public: feeding

    def receive(self, node_id: str, msg: Message, now: float) -> None:
        """Feed a control request from ``node_id``; answers are queued for it."""
        match msg:
            case Claim():
                self._on_claim(node_id, msg)
            case Prepare() | Inventory() | Load() | Stop() if (refusal := self._fence(node_id, msg)):
                self._reply(node_id, Error(msg.ref, ErrorCode.FENCED, refusal))
            case Prepare():
                self._on_prepare(node_id, msg)
            case Inventory():
                self._on_inventory(node_id, msg)
            case Load():
                self._on_load(node_id, msg)
            case Stop():
                if self.state is not StageState.STOPPED:
                    self._events.append(StopRequested(msg.reason))
                    self._set_state(StageState.STOPPED, f"stopped: {msg.reason}")
                self._reply(node_id, Status(msg.ref, self.term, "stopped", msg.reason, 0.0))
            case _:
                self._reply(node_id, Error(msg.ref, ErrorCode.BAD_FIELD,
                                           f"{type(msg).__name__} is not a stage-control request"))

    # -- public: commands from the host

    def slice_progress(self, progress: float, detail: str = "") -> bool:
        """Report slice preparation progress (0..1). False if the stage was stopped."""
        if self._gone():
            return False
        self._require(StageState.PREPARING, "slice_progress()")
        self.progress, self.detail = progress, detail or f"slice {progress:.0%}"
        return True

    def slice_present(self) -> bool:
        """The slice is on disk; the coordinator is told at once. False if stopped."""
        if self._gone():
            return False
        self._require(StageState.PREPARING, "slice_present()")
        self.present, self.progress = True, 1.0
        self._set_state(StageState.PREPARING, "slice present")
        self._reply(self.coordinator_id or "", self._inventory(0))
        return True

    def slice_failed(self, reason: str) -> bool:
        """The slice cannot be made present: FAILED, the coordinator is told."""
        if self._gone():
            return False
        self._require(StageState.PREPARING, "slice_failed()")
        return self._host_failed(reason)

    def loaded(self, n_embd: int, load_ms: float) -> bool:
        """The engine is open: Ready goes to the coordinator. False if the stage was
        stopped meanwhile (the host must then free what it loaded)."""
        if self._gone():
            return False
        self._require(StageState.LOADING, "loaded()")
        self._set_state(StageState.READY, f"loaded in {load_ms:.0f} ms")
        self._reply(self.coordinator_id or "",
                    Ready(self._load_ref, self.term, self.stage_index, n_embd, load_ms))
        return True

    def load_failed(self, reason: str) -> bool:
        """The engine could not be opened: FAILED, Error(ENGINE_ERROR) to the coordinator."""
        if self._gone():
            return False
        self._require(StageState.LOADING, "load_failed()")
        self._set_state(StageState.FAILED, reason)
        self._reply(self.coordinator_id or "", Error(self._load_ref, ErrorCode.ENGINE_ERROR, reason))
        return True

    def fail(self, reason: str) -> bool:
        """The stage broke while serving (engine crash ...): FAILED, the coordinator is told."""
        if self._gone():
            return False
        if self.state is None:
            raise LocalProtocolError("fail() while idle")
        return self._host_failed(reason)

    # -- internals

    def _gone(self) -> bool:
        return self.state in (StageState.STOPPED, StageState.FAILED)

    def _require(self, state: StageState, what: str) -> None:
        if self.state is not state:
            now = self.state.value if self.state else "idle"
            raise LocalProtocolError(f"{what} while the stage is {now}, not {state.value}")

    def _host_failed(self, reason: str) -> bool:
        self._set_state(StageState.FAILED, reason)
        self._reply(self.coordinator_id or "", Status(0, self.term, "failed", reason, self.progress))
        return True

    def _set_state(self, state: StageState, detail: str = "") -> None:
        if state not in _SERVER_TRANSITIONS[self.state]:
            old = self.state.value if self.state else "idle"
            raise LocalProtocolError(f"stage server: {old} -> {state.value} is not allowed")
        log.info("stage server %s (term %d): %s -> %s %s", self.node_id, self.term,
                 self.state.value if self.state else "idle", state.value, detail)
        self.state, self.detail = state, detail
        self._events.append(StageChanged(self.stage))  # type: ignore[arg-type]

    def _reply(self, node_id: str, msg: Message) -> None:
        self._out.append((node_id, msg))

    def _fence(self, node_id: str, msg: Any) -> str:
        """Why ``msg`` is refused as FENCED ('' when it is not)."""
        if msg.term < self.term:
            return f"stale term {msg.term}: this node is at term {self.term} (coordinator {self.coordinator_id})"
        if self.state is None or msg.term != self.term or node_id != self.coordinator_id:
            return f"not claimed by {node_id} for term {msg.term}"
        return ""

    def _on_claim(self, node_id: str, msg: Claim) -> None:
        if msg.coordinator_id != node_id:
            self._reply(node_id, Error(msg.ref, ErrorCode.BAD_FIELD,
                                       f"claim names coordinator {msg.coordinator_id}, sent by {node_id}"))
            return
        same = node_id == self.coordinator_id
        if same and msg.term == self.term and self.state in _SERVING and msg.stage_index == self.stage_index:
            self._reply(node_id, Status(msg.ref, self.term, "claimed", "already claimed", 0.0))  # retransmission
            return
        if self.state in _SERVING and not (same and msg.term > self.term):
            if msg.term <= self.term:
                self._reply(node_id, Error(msg.ref, ErrorCode.FENCED,
                                           f"term {msg.term} <= current term {self.term} of coordinator "
                                           f"{self.coordinator_id}"))
            else:
                self._reply(node_id, Error(msg.ref, ErrorCode.BUSY,
                                           f"serving coordinator {self.coordinator_id} (term {self.term})"))
            return
        if self.state is not None and msg.term <= self.term:
            self._reply(node_id, Error(msg.ref, ErrorCode.FENCED,
                                       f"term {msg.term} <= current term {self.term}"))
            return
        if self.state in _SERVING:   # the same coordinator, restarted with a higher term
            self._events.append(StopRequested(f"superseded by term {msg.term}"))
            self._set_state(StageState.STOPPED, f"superseded by term {msg.term}")
        self.term, self.coordinator_id, self.stage_index = msg.term, node_id, msg.stage_index
        self.model_sha256, self.present, self.progress = msg.model_sha256, False, 0.0
        self.layer_start = self.layer_end = 0
        self._set_state(StageState.ASSIGNED, f"claimed by {node_id}")
        self._events.append(Claimed(node_id, msg.term, msg.stage_index, msg.model_sha256))
        self._reply(node_id, Status(msg.ref, self.term, "claimed", f"stage {msg.stage_index}", 0.0))

    def _on_prepare(self, node_id: str, msg: Prepare) -> None:
        same = (msg.model_sha256, msg.layer_start, msg.layer_end) == (
            self.model_sha256, self.layer_start, self.layer_end)
        if self.state is StageState.ASSIGNED or (self.state is StageState.PREPARING and not same):
            if msg.model_sha256 != self.model_sha256:
                self._reply(node_id, Error(msg.ref, ErrorCode.BAD_FIELD, "prepare names another model than the claim"))
                return
            self.layer_start, self.layer_end = msg.layer_start, msg.layer_end
            self.present, self.progress = False, 0.0
            self._set_state(StageState.PREPARING, "preparing slice")
            self._events.append(PrepareRequested(msg.model_sha256, msg.model_name, msg.layer_start,
                                                 msg.layer_end, msg.n_layers_total))
        elif not (same and self.state in _SERVING):
            self._reply(node_id, Error(msg.ref, ErrorCode.BUSY, f"cannot prepare while {self._state_name()}"))
            return
        self._reply(node_id, self._inventory(msg.ref))   # repeated Prepare: just the inventory

    def _on_inventory(self, node_id: str, msg: Inventory) -> None:
        if self.state not in (StageState.PREPARING, StageState.LOADING, StageState.READY):
            self._reply(node_id, Error(msg.ref, ErrorCode.BUSY, f"no slice requested ({self._state_name()})"))
            return
        self._reply(node_id, self._inventory(msg.ref))

    def _on_load(self, node_id: str, msg: Load) -> None:
        if self.state is StageState.READY and self._load_ref == msg.ref:
            return  # duplicate of the request already answered
        if self.state is not StageState.PREPARING or not self.present:
            self._reply(node_id, Error(msg.ref, ErrorCode.BUSY, f"cannot load while {self._state_name()}"
                                       + (" (slice not present)" if self.state is StageState.PREPARING else "")))
            return
        if (msg.model_sha256, msg.layer_start, msg.layer_end) != (self.model_sha256, self.layer_start, self.layer_end):
            self._reply(node_id, Error(msg.ref, ErrorCode.BAD_FIELD,
                                       f"load of {msg.layer_start}:{msg.layer_end} but {self.layer_start}:"
                                       f"{self.layer_end} was prepared"))
            return
        self._load_ref = msg.ref
        params = LoadParams(msg.n_ctx, msg.n_batch, msg.n_seq_max, msg.wire_dtype)
        self._set_state(StageState.LOADING, "loading")
        self._events.append(LoadRequested(msg.model_sha256, self.stage_index, msg.layer_start, msg.layer_end,
                                          msg.upstream, msg.downstream, msg.coordinator, params))

    def _inventory(self, ref: int) -> Inventory:
        return Inventory(ref, self.term, self.model_sha256, self.layer_start, self.layer_end,
                         self.present, self.progress, "" if self.present else self.detail)

    def _state_name(self) -> str:
        return self.state.value if self.state else "idle"
