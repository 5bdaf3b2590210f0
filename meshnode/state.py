"""The node's public state: what the TUI, `meshnode status` and tests may see.

Theory of operation: the running node owns mutable state; at any time it can produce a
:class:`NodeSnapshot` (frozen dataclasses, cheap to copy, safe to hand to another
thread) and it publishes :class:`NodeEvent`s (past-tense, frozen) as things happen.
Consumers (``ui/``) read snapshots at a bounded rate and react to events; they change
the node only through the command methods of :class:`NodeAPI`. Nothing here imports
asyncio internals of the node, Textual or llama_cpp.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Protocol


def format_step_costs(step_ms) -> str:
    """A route's learned step cost per window (``SpecStats.step_ms``: ``(drafts, ms)``
    pairs, or ``[drafts, ms]`` lists from ``/status``) as 'plain 15.2, 1: 16.8, 3: 19.5 ms'
    ('-' before any step was measured). The TUI and ``meshnode status`` show it."""
    parts = [f"plain {ms:.1f}" if k == 0 else f"{k}: {ms:.1f}" for k, ms in step_ms]
    return ", ".join(parts) + " ms" if parts else "-"


def printable(text: object, limit: int = 200) -> str:
    """``text`` safe to print on a terminal: control characters (ESC sequences that retitle
    the window, move the cursor or rewrite the screen, BEL, CR, and the C1 and bidi
    controls) become ``?``, and at most ``limit`` characters are kept. Peer names, model
    names and details come from other machines: ``meshnode status`` and the TUI show
    them only through this."""
    import unicodedata

    s = str(text)[:limit]
    return "".join("?" if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") else c for c in s)


def node_labels(nodes: Iterable[tuple[str, str]], width: int = 40) -> dict[str, str]:
    """What to call each node on screen, by node id, given (node id, name) pairs: its name
    (:func:`printable`), with the start of its id where several nodes go by that name.
    Names are hostnames by default, and laptops often keep the same one (``ubuntu``,
    ``MacBook-Pro``), as do two nodes on one machine; a stage map or a peer list that
    says ``vm`` twice does not say which. Each label fits in ``width`` characters (a long
    name is cut, never the id)."""
    nodes = list(nodes)
    ids: dict[str, set[str]] = {}
    for node_id, name in nodes:
        ids.setdefault(name, set()).add(node_id)
    return {node_id: (printable(name, width - 7) + "#" + printable(node_id, 6)) if len(ids[name]) > 1
            else printable(name, width) for node_id, name in nodes}


class StageState(enum.Enum):
    ASSIGNED = "assigned"
    PREPARING = "preparing"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class ModelStatus(enum.StrEnum):
    """Where the model this node coordinates stands (``NodeSnapshot.status``)."""

    UNKNOWN = ""             # nothing reported yet
    NO_MODEL = "no model"    # the node coordinates no model (it may serve peers' stages)
    STARTING = "starting"
    FETCHING = "fetching"    # the model file is being downloaded
    PLANNING = "planning"    # the stages are being placed and loaded
    WAITING_FOR_PEERS = "waiting for peers"  # the plan needs more nodes than the mesh has
    READY = "ready"
    RECOVERING = "recovering"  # a stage was lost: re-planning; requests in flight wait
    FAILED = "failed"


class RequestStatus(enum.StrEnum):
    """The life of one request (``RequestInfo.status``)."""

    QUEUED = "queued"
    PREFILL = "prefill"
    DECODING = "decoding"
    DONE = "done"
    CANCELLED = "cancelled"
    ERROR = "error"


class SpecState(enum.Enum):
    OFF = "off"              # speculation disabled for this model / run
    COLD = "cold"            # observing: counting would-be hits, no verify cost
    ENABLED = "enabled"      # drafting and verifying
    COOLING_DOWN = "cooling-down"  # turned itself off after low acceptance


@dataclass(frozen=True, slots=True)
class Capabilities:
    free_ram_bytes: int
    free_vram_bytes: int = 0
    backend: str = "cpu"       # cpu | cuda | metal | vulkan ...
    cores: int = 1
    models: tuple["HeldModel", ...] = ()
    speed: float = 0.0         # measured GFLOP/s of a float32 matmul (0: not measured)
    # bytes/s of this node's latest pulls from peers (0: none yet): what the planner
    # expects its next fetch to move at
    fetch_bytes_per_s: float = 0.0
    # rows its GPU engines pad every smaller call to (meshnode.limits.gpu_pad_rows; 0: not
    # told, the default width): what bounds the exact verify windows of its stages
    gpu_pad_rows: int = 0
    # the CPU threads of the stage it serves for a peer: (now, most) as its engine settled
    # them (meshnode.engine.threads); (0, 0): none, or not a CPU stage
    stage_threads: tuple[int, int] = (0, 0)


@dataclass(frozen=True, slots=True)
class HeldModel:
    name: str
    sha256: str
    n_layers: int
    size_bytes: int = 0
    architecture: str = ""
    shared: bool = False    # members may pull it (meshnode.mesh.share)


@dataclass(frozen=True, slots=True)
class PeerInfo:
    node_id: str
    name: str
    address: str            # "host:port" of its QUIC endpoint
    rtt_ms: float | None
    authenticated: bool
    capabilities: Capabilities | None = None
    role: str = ""          # e.g. "stage 1 [10,20)" or "" when idle
    bytes_per_s_in: float = 0.0
    bytes_per_s_out: float = 0.0
    lane: bool = False      # per-token frames to it take the fast lane (meshnode.net.lane)


@dataclass(frozen=True, slots=True)
class StageInfo:
    index: int
    node_id: str
    node_name: str
    layer_start: int
    layer_end: int          # exclusive
    state: StageState
    detail: str = ""        # e.g. failure reason, load progress
    backend: str = ""       # what the stage computes on: cpu | cuda | ... ("" not known yet)
    gpu_pad_rows: int = 0   # its node's GPU pad width (Capabilities.gpu_pad_rows)
    # CPU threads its engine computes with now, of the most it may use (a CPU engine adapts
    # its count to the cores the machine has free: meshnode.engine.threads); 0: not known
    # (a peer's stage, seen from its coordinator) or not a CPU stage
    threads: int = 0
    max_threads: int = 0

    @property
    def compute(self) -> str:
        """What the stage computes on, as the TUI and ``meshnode status`` print it."""
        return compute_label(self.backend, self.threads, self.max_threads)


def compute_label(backend: str, threads: int = 0, max_threads: int = 0) -> str:
    """``cpu, 2 threads``; ``cpu, 1 of 4 threads`` while it adapted to a busy machine; the
    backend alone where the thread count is not known ("" when nothing is)."""
    if not backend or threads <= 0:
        return backend
    plural = "s" if max(threads, max_threads) != 1 else ""
    if 0 < max_threads and threads < max_threads:
        return f"{backend}, {threads} of {max_threads} thread{plural}"
    return f"{backend}, {threads} thread{plural}"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    path: str
    sha256: str
    n_layers: int
    size_bytes: int
    architecture: str
    kind: str = "model"     # "model" | "slice"
    layer_range: tuple[int, int] | None = None
    source: str = "local"   # "local" | "peer:<name>"


@dataclass(frozen=True, slots=True)
class MeshModel:
    """A model ready to serve somewhere in the mesh: any node's endpoint takes requests
    for it and carries them to its coordinator."""

    name: str
    coordinator_id: str
    coordinator_name: str
    n_ctx: int               # context length per request (0: unknown)
    local: bool = False      # coordinated by this node


@dataclass(frozen=True, slots=True)
class TransferInfo:
    name: str
    done_bytes: int
    total_bytes: int
    what: str = "download"  # download | slice | load | transfer | pull (from a peer)


@dataclass(frozen=True, slots=True)
class RequestInfo:
    request_id: str
    model: str
    status: RequestStatus
    prompt_tokens: int
    generated_tokens: int
    tokens_per_s: float
    ttft_ms: float | None
    started_at: float       # unix time
    finished_at: float | None = None
    strategy: str = ""      # speculative strategy used ("" when none)


@dataclass(frozen=True, slots=True)
class SpecStats:
    strategy: str           # "ngram", "draft", "none"
    state: SpecState
    proposed: int
    accepted: int
    windows: int
    current_window: int
    verify_ms: float        # mean time of a verify pass
    lookahead: int = 0      # lookahead windows sent behind a verify (meshnode.spec.lookahead)
    lookahead_used: int = 0  # ... whose guess held (they became the next window)
    # what the window is sized by (meshnode.spec.window): the route's learned seconds of a
    # step per window, as (drafts, ms) pairs (0 = a plain step), and the running per-token
    # acceptance estimate
    step_ms: tuple[tuple[int, float], ...] = ()
    acceptance_estimate: float = 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass(frozen=True, slots=True)
class TelemetryPoint:
    t: float                # unix time
    tokens_per_s: float
    ttft_ms: float | None
    tpot_ms: float | None   # time per output token
    hop_ms: float | None    # mean per-hop latency
    link_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str
    name: str
    mesh_id: str
    address: str
    http_url: str           # the local OpenAI endpoint, e.g. http://127.0.0.1:8642/v1
    capabilities: Capabilities
    version: str


@dataclass(frozen=True, slots=True)
class FailoverInfo:
    """One re-plan of the model this node coordinates: after a stage was lost
    (``cause`` "lost"), or to use a member that came back (``cause`` "rejoined")."""

    t: float                # unix time of the detection (or of the re-plan's start)
    cause: str              # "lost" | "rejoined"
    reason: str             # what was lost, e.g. "stage 1 on b: link lost: ..."
    stages_before: int
    stages_after: int       # 0: no route was found (requests in flight got an error)
    resume_ms: float        # detection -> the model serving again (or giving up)
    requests: int = 0       # requests in flight that waited for the new route


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    node: NodeInfo
    peers: tuple[PeerInfo, ...]
    model: str | None                 # the model this node coordinates / serves
    model_layers: int
    stages: tuple[StageInfo, ...]
    requests: tuple[RequestInfo, ...]  # active first, then recent
    spec: tuple[SpecStats, ...]
    telemetry: tuple[TelemetryPoint, ...]  # recent history, oldest first
    models: tuple[ModelInfo, ...]
    transfers: tuple[TransferInfo, ...]
    status: ModelStatus = ModelStatus.UNKNOWN   # the model service
    status_detail: str = ""           # why, for failed; what, while fetching
    mesh_models: tuple[MeshModel, ...] = ()   # every model ready in the mesh, this node's first
    failovers: tuple[FailoverInfo, ...] = ()   # recent re-plans, newest first


# ---- events (past tense) ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeerDiscovered:
    peer: PeerInfo


@dataclass(frozen=True, slots=True)
class PeerLost:
    node_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class StageChanged:
    stage: StageInfo


@dataclass(frozen=True, slots=True)
class RequestUpdated:
    request: RequestInfo


@dataclass(frozen=True, slots=True)
class DraftVerified:
    """One speculative window: ``proposed`` tokens, the first ``n_accepted`` kept."""

    request_id: str
    strategy: str
    proposed: tuple[str, ...]   # token texts, for display
    n_accepted: int
    bonus: str                  # the token the target produced after the accepted prefix
    t: float = 0.0


@dataclass(frozen=True, slots=True)
class LogEmitted:
    level: int
    logger: str
    message: str
    t: float


@dataclass(frozen=True, slots=True)
class ModelReplanned:
    """The model was re-planned (a failover, or a return to a member that came back)."""

    info: FailoverInfo


NodeEvent = (PeerDiscovered | PeerLost | StageChanged | RequestUpdated | DraftVerified | LogEmitted
             | ModelReplanned)


class NodeAPI(Protocol):
    """The seam between the node and any front end (TUI, status command, tests)."""

    def snapshot(self) -> NodeSnapshot:
        """A consistent copy of the node's state now; cheap, callable from any thread."""
        ...

    def events(self) -> AsyncIterator[NodeEvent]:
        """A new subscription to events from now on (bounded queue; slow readers lose the oldest)."""
        ...

    @property
    def http_url(self) -> str: ...
