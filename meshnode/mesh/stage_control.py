"""Stage control: the Claim -> Prepare -> Inventory -> Load -> Ready negotiation, sans-IO.

Theory of operation. Two state machines, neither touching a socket or a clock (the
aioquic / h11 pattern), one per side of the negotiation:

* :class:`~meshnode.mesh.stage_control_coordinator.CoordinatorControl`
  (:mod:`meshnode.mesh.stage_control_coordinator`) runs on the coordinator (stage 0) for
  one :class:`~meshnode.mesh.planner.Plan`. It claims every remote stage, asks it to
  prepare its slice, polls its Inventory until the slice is present, then loads it; its
  own stage 0 is loaded by the host from the start (event :class:`LocalLoadRequested`,
  answered with ``local_stage_ready()``). The loads overlap; the plan is ready when
  every stage is.
* :class:`~meshnode.mesh.stage_control_server.StageServerControl`
  (:mod:`meshnode.mesh.stage_control_server`) runs on every node that may serve a
  stage. It answers the coordinator, enforces fencing by term, and asks its host to do
  the real work through events (:class:`PrepareRequested`, :class:`LoadRequested`,
  :class:`StopRequested`); the host reports back with commands (``slice_present()``,
  ``loaded()`` ...).

This module holds what both sides and their hosts share: the parameters
(:class:`LoadParams`, :class:`Timeouts`), the events the machines emit, the error
they raise, and :func:`stages_json`.

The caller feeds both machines with ``receive(node_id, msg, now)`` and
``handle_timer(now)``, then drains ``messages_to_send()`` (``(node_id, message)``
pairs), ``next_event()`` and re-arms its timer from ``get_timer()``. Stage states as
the UI sees them are :class:`meshnode.state.StageState`; each change is published as
:class:`meshnode.state.StageChanged`.

Errors: misuse by the host (a command in the wrong state) raises
:class:`StageControlError`; a peer's bad or stale request is answered with a wire
``Error`` (FENCED, BUSY, BAD_FIELD) and never raises.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from meshnode.limits import DEFAULT_KV_TYPE, KV_CACHE_TYPES, MAX_SEQ
from meshnode.state import StageChanged, StageInfo
from meshnode.wire import ErrorCode, LocalProtocolError, Message

__all__ = [
    "ClaimLease",
    "Claimed",
    "CoordinatorEvent",
    "LoadLimits",
    "LoadParams",
    "LoadRequested",
    "LocalLoadRequested",
    "PlanFailed",
    "PlanReady",
    "PrepareRequested",
    "ServerEvent",
    "StageControlError",
    "StopRequested",
    "Timeouts",
    "check_load",
    "stages_json",
]


class StageControlError(LocalProtocolError):
    """The host used a stage-control state machine wrongly (a command in a state that
    forbids it). A wire :class:`~meshnode.wire.LocalProtocolError`: our own bug, never
    the peer's."""

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
    kv_type: str = DEFAULT_KV_TYPE   # KV cache type: results depend on it, so one for all


GIB = 1024 ** 3


@dataclass(frozen=True, slots=True)
class LoadLimits:
    """What a stage server lets a coordinator's Load ask for (measured by the host once
    the slice is present). ``n_ctx_train``: the model's trained context (GGUF
    ``context_length``, 0 = unknown); ``budget_bytes``: this node's memory budget
    (``--max-memory``, else its free RAM; None = unchecked). The rest feeds
    :meth:`need_bytes`, an estimate of what llama.cpp allocates for the stage."""

    n_ctx_train: int = 0
    budget_bytes: int | None = None
    weights_bytes: int = 0           # the slice file (mapped)
    kv_bytes_per_cell: int = 0       # K and V of every layer of the slice, one token
    n_embd: int = 0
    n_head: int = 0
    n_vocab: int = 0                 # 0 unless the slice has the head (logits buffer)
    overhead_bytes: int = 0

    def need_bytes(self, p: "LoadParams") -> int:
        cells = p.n_ctx * p.n_seq_max
        act = p.n_batch * self.n_embd * 4 * 8             # activations, tap, batch buffers
        scores = p.n_batch * cells * max(self.n_head, 1) * 4   # attention scores (no flash attention)
        logits = p.n_batch * self.n_vocab * 4
        return self.weights_bytes + self.kv_bytes_per_cell * cells + act + scores + logits + self.overhead_bytes


def check_load(p: "LoadParams", limits: "LoadLimits | None", where: str = "this node") -> str:
    """Why a stage must not load with ``p`` ('' when it may): a peer's Load is checked
    against the model's trained context and ``where``'s memory budget before any
    engine allocates."""
    if min(p.n_ctx, p.n_batch, p.n_seq_max) < 1:
        return "n_ctx, n_batch and n_seq_max must be >= 1"
    if p.n_seq_max > MAX_SEQ:
        return f"n_seq_max {p.n_seq_max} is above llama.cpp's limit of {MAX_SEQ} sequences"
    if p.wire_dtype not in ("f32", "f16"):
        return f"wire dtype must be 'f32' or 'f16', not {p.wire_dtype!r}"
    if p.kv_type not in KV_CACHE_TYPES:
        return f"KV cache type must be one of {', '.join(KV_CACHE_TYPES)}, not {p.kv_type!r}"
    if limits is None:
        return ""
    if limits.n_ctx_train and p.n_ctx > limits.n_ctx_train:
        return f"n_ctx {p.n_ctx} is above the model's trained context of {limits.n_ctx_train} tokens"
    if limits.budget_bytes is not None:
        need = limits.need_bytes(p)
        if need > limits.budget_bytes:
            return (f"n_ctx {p.n_ctx} x n_seq_max {p.n_seq_max} (n_batch {p.n_batch}) needs about "
                    f"{need / GIB:.2f} GiB on {where}, over its memory budget of "
                    f"{limits.budget_bytes / GIB:.2f} GiB (--max-memory)")
    return ""


@dataclass(frozen=True, slots=True)
class ClaimLease:
    """Seconds a claimed stage waits for its coordinator to go on (stage server side).

    ``claim``: after Claim, Prepare must come, and while the slice is being prepared the
    coordinator polls Inventory (every 0.5 s), so this much silence means it will not go
    on. ``load``: once the slice is present, how long to wait for Load (the coordinator
    sends it at once; a generous bound). A lease that runs out
    stops the stage and frees what it holds: a member cannot pin a node with a Claim."""

    claim: float = 60.0
    load: float = 1800.0


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

E = TypeVar("E")


class MachineOutput(Generic[E]):
    """What a stage-control machine leaves for its host: messages to send and events to
    handle, drained by the host after every input (aioquic's ``datagrams_to_send`` /
    ``next_event`` pattern). Both machines inherit it."""

    def __init__(self) -> None:
        self._out: list[tuple[str, Message]] = []
        self._events: deque[E] = deque()

    def messages_to_send(self) -> list[tuple[str, Message]]:
        """Drain the queued ``(node_id, message)`` pairs; send them in order."""
        out, self._out = self._out, []
        return out

    def next_event(self) -> E | None:
        """The next event, or None when there is none."""
        return self._events.popleft() if self._events else None


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
