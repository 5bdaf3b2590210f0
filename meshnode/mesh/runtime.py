"""What the asyncio drivers of stage negotiation share: options, results, helpers.

Theory of operation. Stage negotiation is split in these modules:

* the sans-IO state machines (no I/O, no clock): :mod:`meshnode.mesh.stage_control_coordinator`
  and :mod:`meshnode.mesh.stage_control_server`, over the events and parameters both share
  in :mod:`meshnode.mesh.stage_control`;
* :mod:`meshnode.mesh.stage_server` -- :class:`StageServerRuntime`, run by every node:
  feeds its :class:`StageServerControl` and does the host work (find the model, slice
  it, load an engine, serve the data plane with a :class:`StageHost`);
* :mod:`meshnode.mesh.coordinator` -- :class:`CoordinatorRuntime`, run by the node that
  coordinates a model (stage 0): plans, feeds :class:`CoordinatorControl`, loads stage 0
  and builds the pipeline.

Both drivers are thin, like aioquic's asyncio layer: feed the machine, drain its
messages into an :class:`Outbox` (one ordered sender task), handle its events, re-arm
its one timer. This module holds what both need: :class:`ServeOptions`, the persistent
coordinator term (:class:`TermStore`), the models a node holds (:func:`held_models`,
:func:`node_capabilities`) and the planner's view of a GGUF (:func:`model_shape`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshnode.errors import MeshnodeError
from meshnode.fsutil import atomic_write
from meshnode.mesh.fabric_api import Fabric
from meshnode.gguf_files import model_size
from meshnode.mesh.local_caps import advertised, local_capabilities
from meshnode.mesh.planner import ModelShape
from meshnode.mesh.stage_control import LoadLimits, Timeouts
from meshnode.models.errors import ModelFileError
from meshnode.net import caps as capsmod
from meshnode.paths import NodePaths
from meshnode.state import HeldModel, NodeEvent
from meshnode.wire import Message

__all__ = [
    "DEFAULT_STAGE_OVERHEAD",
    "NegotiationError",
    "Outbox",
    "Publish",
    "ServeOptions",
    "TermStore",
    "find_held_model",
    "held_models",
    "load_limits",
    "model_shape",
    "trained_context",
    "warm_headers",
    "node_capabilities",
]

log = logging.getLogger(__name__)

# Charged once per stage by the planner: llama.cpp compute buffers, the batch, logits.
DEFAULT_STAGE_OVERHEAD = 64 * 1024 * 1024
TERM_FILE = "coordinator-term"

Publish = Callable[[NodeEvent], None]


class NegotiationError(MeshnodeError):
    """Stage negotiation failed (``PlanFailed``); ``reason`` names the stage and why."""

    def __init__(self, reason: str, stage_index: int | None = None) -> None:
        super().__init__(f"cannot start the model: {reason}")
        self.reason = reason
        self.stage_index = stage_index


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """How the coordinator plans and loads a model.

    ``split``: force this many stages (``--split N``); ``explicit``: ``"nodeA=0:10,
    nodeB=10:30"`` (``--stages``); neither: the planner chooses. ``max_memory``: this
    node's budget in bytes (``--max-memory``); peers apply their own budgets to the free
    memory they advertise (:func:`node_capabilities`). ``wire_dtype``: 'f32' (exact) or
    'f16' (half the bytes on the wire).
    """

    split: int | None = None
    explicit: str | None = None
    max_memory: int | None = None
    n_ctx: int = 2048
    n_batch: int = 256
    n_seq_max: int = 4
    wire_dtype: str = "f32"
    timeouts: Timeouts = field(default_factory=Timeouts)
    stop_timeout: float = 5.0           # seconds to wait for Status(stopped) answers
    stage_overhead: int = DEFAULT_STAGE_OVERHEAD

    def __post_init__(self) -> None:
        if self.wire_dtype not in ("f32", "f16"):
            raise MeshnodeError(f"wire dtype must be 'f32' or 'f16', not {self.wire_dtype!r}")
        if min(self.n_ctx, self.n_batch, self.n_seq_max) < 1:
            raise MeshnodeError("n_ctx, n_batch and n_seq_max must be >= 1")


# ---- the coordinator's term ---------------------------------------------------------


class TermStore:
    """A persistent, strictly increasing counter under ``paths.state``.

    Every plan a coordinator starts uses :meth:`next_term`, so a restarted coordinator
    always claims with a higher term than before (stage servers fence lower ones).
    """

    def __init__(self, paths: NodePaths) -> None:
        self.path = paths.state / TERM_FILE

    def current(self) -> int:
        """The last term handed out (0 when none)."""
        with contextlib.suppress(OSError, ValueError):
            return max(0, int(self.path.read_text().strip() or 0))
        return 0

    def next_term(self) -> int:
        """A term higher than every one handed out before; persisted before it returns."""
        return self.advance_to(self.current() + 1)

    def advance_to(self, term: int) -> int:
        """Make ``term`` the current term (never lowers it); returns the current term."""
        term = max(term, self.current())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(self.path, "w") as f:
            f.write(f"{term}\n")  # type: ignore[arg-type]
        return term


# ---- held models and capabilities ---------------------------------------------------


def held_models(paths: NodePaths, *, shared: bool = False) -> list[HeldModel]:
    """The models in this node's store, as advertised in capabilities.

    Blocking (a GGUF without a record is hashed once): call it from a thread. A store
    holding a damaged file advertises nothing rather than failing the node.
    """
    from meshnode.models.store import list_models

    try:
        refs = list_models(paths, progress=lambda *_: None)
    except (ModelFileError, OSError) as exc:
        log.warning("cannot list the model store: %s", exc)
        return []
    from meshnode.models.sharing import unshared

    kept = unshared(paths) if shared else set()
    return [HeldModel(r.name, r.sha256, r.n_layers, model_size(Path(r.path)), r.architecture, shared and r.sha256 not in kept)
            for r in refs]


def find_held_model(paths: NodePaths, sha256: str) -> Any:
    """The store's :class:`~meshnode.models.store.ModelRef` with ``sha256``, or None.

    Blocking, like :func:`held_models`."""
    from meshnode.models.store import list_models

    try:
        refs = list_models(paths, progress=lambda *_: None)
    except (ModelFileError, OSError) as exc:
        log.warning("cannot list the model store: %s", exc)
        return None
    return next((r for r in refs if r.sha256 == sha256), None)


def node_capabilities(paths: NodePaths, *, max_memory: int | None = None,
                      models: list[HeldModel] | None = None, share: bool = False,
                      fetch_bytes_per_s: float = 0.0, parked_bytes: int = 0,
                      parked_vram: int = 0, stage_threads: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """This node's capability dict for :class:`MeshFabric` (``capabilities=`` or
    ``set_capabilities``): free RAM capped by ``max_memory``, the held models and the
    measured rate of its pulls. ``parked_bytes``: the memory of the engines the node keeps
    for a moment after a re-plan (:mod:`meshnode.engine.shelf`), free to a new stage since
    they are closed before anything else loads; ``parked_vram`` the same engines' device
    memory (added to the free VRAM of a node that offloads); ``stage_threads`` the CPU
    threads of the stage it serves for a peer (``StageServerRuntime.served_threads``).

    Blocking when ``models`` is None (lists the store)."""
    held = tuple(held_models(paths, shared=share) if models is None else models)
    me = local_capabilities(held)
    me = dataclasses.replace(me, free_ram_bytes=me.free_ram_bytes + advertised(parked_bytes),
                             free_vram_bytes=me.free_vram_bytes + (advertised(parked_vram) if me.backend != "cpu" else 0),
                             fetch_bytes_per_s=fetch_bytes_per_s, stage_threads=stage_threads)
    caps = capsmod.to_dict(me)
    if max_memory is not None:
        caps["free_ram"] = min(int(caps["free_ram"]), int(max_memory))
    return caps


# ---- the planner's view of a model ----------------------------------------------------


# The {arch}.<key> metadata the planner and the stage servers read beside the tensors.
_HEADER_KEYS = ("attention.head_count", "attention.head_count_kv", "attention.key_length",
                "attention.value_length", "context_length")
_HEADER_CACHE = 8   # files' headers kept (a node serves one model; its slices are files too)


@dataclass(frozen=True, slots=True)
class _Header:
    info: Any                  # meshnode.models.gguf_info.GGUFInfo
    fields: dict[str, Any]     # _HEADER_KEYS -> value (None when absent)


_headers: dict[tuple, _Header] = {}
_headers_lock = threading.Lock()


def _header(path: Any) -> _Header:
    """What :func:`model_shape`, :func:`trained_context` and :func:`load_limits` read of
    the GGUF at ``path``, parsed once per version of the file. Parsing a header means its
    tokenizer arrays: ~0.1-0.2 s for SmolLM2 on the 2-core VM, and every stage server of a
    re-plan read it twice, most of a failover's re-plan. Keyed by the path and the file's
    size, mtime and inode, so a file replaced in place is read again. Blocking; raises
    ModelFileError (as :func:`~meshnode.models.gguf_info.open_gguf`)."""
    from meshnode.models.gguf_info import field_value, info_from_reader, open_gguf

    p = Path(path)
    try:
        st = p.stat()
        key: tuple | None = (str(p), st.st_size, st.st_mtime_ns, st.st_ino)
    except OSError:
        key = None   # open_gguf says what is wrong
    with _headers_lock:
        hit = _headers.get(key) if key is not None else None
    if hit is not None:
        return hit
    reader = open_gguf(p)
    info = info_from_reader(reader, p)
    header = _Header(info, {k: field_value(reader, f"{info.architecture}.{k}") for k in _HEADER_KEYS})
    if key is not None:
        with _headers_lock:
            if len(_headers) >= _HEADER_CACHE:
                _headers.pop(next(iter(_headers)))   # the oldest
            _headers[key] = header
    return header


def warm_headers(paths: NodePaths, limit: int = _HEADER_CACHE // 2) -> None:
    """Parse the headers of (up to ``limit`` of) the store's models ahead of need, so that
    this node's first Prepare of a model, e.g. as a failover's substitute, does not wait
    for it (a Llama-3 tokenizer's header takes longer than SmolLM2's). Blocking."""
    from meshnode.models.store import list_models

    try:
        refs = list_models(paths, progress=lambda *_: None)
    except (ModelFileError, OSError):
        return   # (held_models says so when it advertises)
    for ref in refs[:limit]:
        with contextlib.suppress(ModelFileError, OSError):
            _header(ref.path)


def model_shape(path: Any, n_ctx: int, *, overhead_bytes: int = DEFAULT_STAGE_OVERHEAD) -> ModelShape:
    """:class:`ModelShape` of the GGUF at ``path`` for ``n_ctx`` tokens per session.

    Layer bytes are each block's tensor bytes; the embedding is ``token_embd``; the head
    is ``output.weight`` (``token_embd`` again when tied) plus ``output_norm``; KV per
    token and layer is ``n_head_kv * (key_length + value_length) * 2`` bytes (f16 K and
    V). Blocking (reads the GGUF header once, :func:`_header`). Raises ModelFileError.
    """
    h = _header(path)
    info = h.info
    other = {t.name: t.n_bytes for t in info.other_tensors}
    embed = other.get("token_embd.weight", 0)
    head = other.get("output.weight", embed) + other.get("output_norm.weight", 0)
    return ModelShape(
        n_layers=info.n_layers,
        layer_bytes=tuple(sum(t.n_bytes for t in blk) for blk in info.blocks),
        embed_bytes=embed,
        head_bytes=head,
        n_embd=info.n_embd,
        n_ctx=n_ctx,
        kv_bytes_per_token=_kv_bytes_per_token(h),
        overhead_bytes=overhead_bytes,
    )


def _n_head(h: _Header) -> int:
    return _as_max(h.fields["attention.head_count"]) or 1


def _kv_bytes_per_token(h: _Header) -> int:
    """KV bytes of one token in one layer: f16 K and V of every KV head."""
    n_head = _n_head(h)
    n_head_kv = _as_max(h.fields["attention.head_count_kv"]) or n_head
    k_len = _as_max(h.fields["attention.key_length"]) or h.info.n_embd // n_head
    v_len = _as_max(h.fields["attention.value_length"]) or k_len
    return n_head_kv * (k_len + v_len) * 2


def trained_context(path: Any) -> int:
    """The model's trained context (GGUF ``{arch}.context_length``; 0 when absent).
    Blocking (reads the GGUF header once, :func:`_header`)."""
    return _as_max(_header(path).fields["context_length"])


def load_limits(model_path: Any, slice_path: Any, layer_start: int, layer_end: int, *,
                budget_bytes: int | None, n_layers_total: int | None = None,
                overhead_bytes: int = DEFAULT_STAGE_OVERHEAD) -> LoadLimits:
    """What a stage server lets a Load ask for, for blocks [start, end) of the model at
    ``model_path`` sliced to ``slice_path``: the trained context and the memory estimate
    of :class:`LoadLimits` under ``budget_bytes``. A node that fetched only the slice passes
    it as ``model_path`` too, with the model's ``n_layers_total``. Blocking (reads the GGUF
    header once, :func:`_header`)."""
    h = _header(model_path)
    info = h.info
    return LoadLimits(
        n_ctx_train=_as_max(h.fields["context_length"]),
        budget_bytes=budget_bytes,
        weights_bytes=model_size(Path(slice_path)),
        kv_bytes_per_cell=_kv_bytes_per_token(h) * (layer_end - layer_start),
        n_embd=info.n_embd,
        n_head=_n_head(h),
        n_vocab=info.n_vocab if layer_end == (n_layers_total or info.n_layers) else 0,
        overhead_bytes=overhead_bytes,
    )


def _as_max(value: Any) -> int:
    """A metadata int, or the largest entry of a per-layer array; 0 when absent."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)):
        ints = [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
        return max(ints, default=0)
    return 0


# ---- sending ------------------------------------------------------------------------------


def drain(control: Any, outbox: "Outbox") -> Iterator[Any]:
    """Drive a sans-IO stage-control machine: queue what it wants sent, yield its events.

    The one pump loop both drivers share (aioquic's asyncio layer does the same: feed,
    drain datagrams, drain events)."""
    while True:
        for node_id, msg in control.messages_to_send():
            outbox.put(node_id, msg)
        ev = control.next_event()
        if ev is None:
            return
        yield ev


class Outbox:
    """Sends ``(node_id, message)`` pairs on the control stream, in order, from one task.

    The state machines queue replies synchronously; this keeps their order on the wire
    and keeps a gone peer (``PeerUnavailableError``) from reaching the machine: a lost
    peer is reported through ``on_peer_change`` instead.
    """

    def __init__(self, fabric: Fabric, name: str) -> None:
        self.fabric = fabric
        self.name = name
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    def put(self, node_id: str, msg: Message) -> None:
        if self._task is None or self._task.done():
            self._queue = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._run(self._queue), name=self.name)
        assert self._queue is not None
        self._queue.put_nowait((node_id, msg))

    async def flush(self) -> None:
        """Wait until everything queued so far was handed to the fabric."""
        if self._queue is not None and self._task is not None and not self._task.done():
            await self._queue.join()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def _run(self, queue: asyncio.Queue) -> None:
        from meshnode.mesh.fabric import PeerUnavailableError

        while True:
            node_id, msg = await queue.get()
            try:
                await self.fabric.send(node_id, msg)
            except PeerUnavailableError as exc:
                # (the peer is gone: its loss is logged and handled where links are)
                log.debug("%s: %s to %s not sent: %s", self.name, type(msg).__name__, node_id, exc)
            except Exception:  # noqa: BLE001 - one bad message must not stop the sender
                log.exception("%s: sending %s to %s failed", self.name, type(msg).__name__, node_id)
            finally:
                queue.task_done()

