"""Stage control, serving side: the sans-IO machine that answers a coordinator.

Theory of operation. :class:`StageServerControl` runs on every node that may serve a
stage (at most one stage at a time). It answers Claim / Prepare / Inventory / Load /
Stop from the coordinator that claimed it, refuses stale or foreign requests by term
(fencing: FENCED / BUSY), and asks its host to do the real work through events
(:class:`~meshnode.mesh.stage_control.PrepareRequested`,
:class:`~meshnode.mesh.stage_control.LoadRequested`,
:class:`~meshnode.mesh.stage_control.StopRequested`); the host reports back with
commands (``slice_present()``, ``loaded()`` ...), which queue the answers. A peer's bad
request is answered with a wire ``Error`` and never raises; a host command in the wrong
state raises :class:`~meshnode.mesh.stage_control.StageControlError`.

No socket and no clock; one timer, the claim lease (:class:`ClaimLease`): a stage
claimed but not loaded stops when its coordinator does not go on in time, so a member
cannot hold a node with a Claim. Load parameters are checked against the host's
:class:`LoadLimits` (the model's trained context, the memory budget) before any engine
is asked for (``Error(BAD_FIELD)`` with the reason). A coordinator's liveness while
READY is the link's job (the host fails the stage when the link drops).
"""

from __future__ import annotations

import logging

from meshnode.mesh.stage_control import (
    ClaimLease,
    Claimed,
    LoadLimits,
    LoadParams,
    LoadRequested,
    MachineOutput,
    PrepareRequested,
    ServerEvent,
    StageControlError,
    StopRequested,
    check_load,
)
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
    StageStatus,
    Status,
    Stop,
)

__all__ = ["StageServerControl"]

log = logging.getLogger(__name__)

# ---- transition table -----------------------------------------------------------
#
# Rules (read these before changing the table):
#
# Stage server (StageState, None = idle). A Claim is accepted when idle, or when the
# stage is STOPPED/FAILED and the claim's term is higher than the current term, or from
# the *same* coordinator with a higher term (a restarted coordinator supersedes its own
# old assignment). A Claim from another coordinator while serving is refused: FENCED when
# its term <= current term, BUSY otherwise. Every later request must carry the current
# term and come from the claiming coordinator, else FENCED.

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


class StageServerControl(MachineOutput[ServerEvent]):
    """The serving side of stage negotiation on one node (at most one stage at a time).

    ``state`` is None while idle, else a :class:`StageState`. ``term`` is the highest
    term this node accepted; requests with another term are FENCED.
    """

    def __init__(self, node_id: str, now: float, *, name: str = "",
                 lease: ClaimLease = ClaimLease()) -> None:
        super().__init__()
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
        self.lease = lease
        self.limits: LoadLimits | None = None   # set by the host with slice_present()
        self._heard = now                 # last valid request from the claiming coordinator
        self._present_at = now
        self._lease_until: float | None = None
        self._lapsed = False              # the last claim's lease ran out (see _on_claim)

    # -- public: reading

    @property
    def stage(self) -> StageInfo | None:
        """This node's stage as the UI shows it (None while idle)."""
        if self.state is None:
            return None
        return StageInfo(self.stage_index, self.node_id, self.name, self.layer_start, self.layer_end,
                         self.state, self.detail)

    def get_timer(self) -> float | None:
        """When the claim lease runs out (None: no lease running)."""
        return self._lease_until

    def handle_timer(self, now: float) -> None:
        """Stop a claimed stage whose coordinator did not go on within the lease."""
        if self._lease_until is None or now < self._lease_until:
            return
        self._lease_until = None
        if self.state not in (StageState.ASSIGNED, StageState.PREPARING):
            return
        waited = "Load" if self.present else "Prepare / Inventory"
        reason = f"claim lease expired: no {waited} from {self.coordinator_id} in time"
        self._lapsed = True
        self._events.append(StopRequested(reason))
        self._set_state(StageState.STOPPED, reason)
        self._reply(self.coordinator_id or "", Status(0, self.term, StageStatus.FAILED, reason, self.progress))

    def _arm_lease(self) -> None:
        if self.state is StageState.ASSIGNED or (self.state is StageState.PREPARING and not self.present):
            self._lease_until = self._heard + self.lease.claim
        elif self.state is StageState.PREPARING:
            self._lease_until = self._present_at + self.lease.load
        else:
            self._lease_until = None

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
                self._reply(node_id, Status(msg.ref, self.term, StageStatus.STOPPED, msg.reason, 0.0))
            case _:
                self._reply(node_id, Error(getattr(msg, "ref", 0), ErrorCode.BAD_FIELD,
                                           f"{type(msg).__name__} is not a stage-control request"))
        if node_id == self.coordinator_id and getattr(msg, "term", None) == self.term:
            self._heard = now    # the claimant goes on: its lease starts again
        self._arm_lease()

    # -- public: commands from the host

    def slice_progress(self, progress: float, detail: str = "") -> bool:
        """Report slice preparation progress (0..1). False if the stage was stopped."""
        if self._gone():
            return False
        self._require(StageState.PREPARING, "slice_progress()")
        self.progress, self.detail = progress, detail or f"slice {progress:.0%}"
        return True

    def slice_present(self, limits: LoadLimits | None = None, now: float | None = None) -> bool:
        """The slice is on disk; the coordinator is told at once. False if stopped.

        ``limits``: what a Load may ask for (None: only the structural checks);
        ``now``: when (starts the load lease; default: the last request heard)."""
        if self._gone():
            return False
        self._require(StageState.PREPARING, "slice_present()")
        self.limits = limits
        self._present_at = self._heard if now is None else now
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
            raise StageControlError("fail() while idle")
        return self._host_failed(reason)

    # -- internals

    def _gone(self) -> bool:
        return self.state in (StageState.STOPPED, StageState.FAILED)

    def _require(self, state: StageState, what: str) -> None:
        if self.state is not state:
            now = self.state.value if self.state else "idle"
            raise StageControlError(f"{what} while the stage is {now}, not {state.value}")

    def _host_failed(self, reason: str) -> bool:
        self._set_state(StageState.FAILED, reason)
        self._reply(self.coordinator_id or "", Status(0, self.term, StageStatus.FAILED, reason, self.progress))
        return True

    def _set_state(self, state: StageState, detail: str = "") -> None:
        if state not in _SERVER_TRANSITIONS[self.state]:
            old = self.state.value if self.state else "idle"
            raise StageControlError(f"stage server: {old} -> {state.value} is not allowed")
        log.info("stage server %s (term %d): %s -> %s %s", self.node_id, self.term,
                 self.state.value if self.state else "idle", state.value, detail)
        self.state, self.detail = state, detail
        self._events.append(StageChanged(self.stage))  # type: ignore[arg-type]
        self._arm_lease()

    def _reply(self, node_id: str, msg: Message) -> None:
        self._out.append((node_id, msg))

    def _fence(self, node_id: str, msg: Message) -> str:
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
            self._reply(node_id, Status(msg.ref, self.term, StageStatus.CLAIMED, "already claimed", 0.0))  # retransmission
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
        # A claim whose lease ran out fences nobody else: otherwise a member could claim
        # with the highest term, never go on, and keep every other coordinator out.
        lapsed = self._lapsed and self.state is StageState.STOPPED and not same
        if self.state is not None and msg.term <= self.term and not lapsed:
            self._reply(node_id, Error(msg.ref, ErrorCode.FENCED,
                                       f"term {msg.term} <= current term {self.term}"))
            return
        if self.state in _SERVING:   # the same coordinator, restarted with a higher term
            self._events.append(StopRequested(f"superseded by term {msg.term}"))
            self._set_state(StageState.STOPPED, f"superseded by term {msg.term}")
        self._lapsed, self.limits = False, None
        self.term, self.coordinator_id, self.stage_index = msg.term, node_id, msg.stage_index
        self.model_sha256, self.present, self.progress = msg.model_sha256, False, 0.0
        self.layer_start = self.layer_end = 0
        self._set_state(StageState.ASSIGNED, f"claimed by {node_id}")
        self._events.append(Claimed(node_id, msg.term, msg.stage_index, msg.model_sha256))
        self._reply(node_id, Status(msg.ref, self.term, StageStatus.CLAIMED, f"stage {msg.stage_index}", 0.0))

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
        if msg.coordinator != node_id or not msg.upstream or msg.upstream == self.node_id \
                or msg.downstream == self.node_id:
            self._reply(node_id, Error(msg.ref, ErrorCode.BAD_FIELD,
                                       "load must name its sender as coordinator and another node upstream"))
            return
        params = LoadParams(msg.n_ctx, msg.n_batch, msg.n_seq_max, msg.wire_dtype, msg.kv_type)
        refusal = check_load(params, self.limits, self.name)
        if refusal:
            log.warning("stage server %s: load refused: %s", self.node_id, refusal)
            self._reply(node_id, Error(msg.ref, ErrorCode.BAD_FIELD, f"{self.name} refuses the load: {refusal}"))
            return
        self._load_ref = msg.ref
        self._set_state(StageState.LOADING, "loading")
        self._events.append(LoadRequested(msg.model_sha256, self.stage_index, msg.layer_start, msg.layer_end,
                                          msg.upstream, msg.downstream, msg.coordinator, params))

    def _inventory(self, ref: int) -> Inventory:
        return Inventory(ref, self.term, self.model_sha256, self.layer_start, self.layer_end,
                         self.present, self.progress, "" if self.present else self.detail)

    def _state_name(self) -> str:
        return self.state.value if self.state else "idle"
