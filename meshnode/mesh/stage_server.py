"""The asyncio driver of :class:`StageServerControl`: serving a stage for another node.

Theory of operation. Every node runs one :class:`StageServerRuntime`. The node's message
dispatcher hands it each message with :meth:`StageServerRuntime.handle`; it takes the
stage-control requests (Claim, Prepare, Inventory from its coordinator, Load, Stop) and
the data plane of the stage it serves (Forward, Trim, SessionEnd, SessionCopy), and returns False for
anything else. After each feed it drains the machine: replies go to an :class:`Outbox`,
events become host work:

* ``PrepareRequested``: find the model by sha256 in this node's store and build the
  slice with :class:`SliceCache` in a thread, reporting progress; ``slice_present()``.
  A model not held is fetched: the range's layer package comes from the peers that share
  the model (:class:`~meshnode.mesh.share.ShareService`, verified chunk by chunk, kept in
  the slice cache), with the bytes done reported as progress; no sharing peer fails the
  stage with a clear reason.
  Once present, the host measures what a Load may ask for (:func:`load_limits`: the
  model's trained context, the memory the parameters would take against
  ``--max-memory``, else free RAM) and hands it to ``slice_present()``; the machine
  refuses a Load over it.
* ``LoadRequested``: open an :class:`EngineWorker` on the slice (hidden states in; logits
  out on the last stage; from the node's :class:`EngineShelf`, which hands back the engine
  a re-plan just freed when the slice and parameters are the same) and start a :class:`StageHost` fed only by the upstream node the
  Load named and routed to the downstream stage (or back to the coordinator);
  ``loaded()``.
* ``StopRequested`` / the stage turning FAILED: close the host and free the engine
  (parked on the shelf for a while: :mod:`meshnode.engine.shelf`).

Host work runs in tasks tagged with the claim they belong to (term, coordinator, range);
a result that arrives after the stage was stopped or re-claimed is freed, never reported.
The machine's one timer is the claim lease (a claim not followed by Prepare / Load in
time stops the stage); it is re-armed after every feed. When the link to the claiming
coordinator drops, the stage fails and its memory is freed (the coordinator fails its
plan on the same loss).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshnode import wire
from meshnode.engine.shelf import EngineShelf
from meshnode.errors import MeshnodeError
from meshnode.mesh.control_timer import ControlTimer
from meshnode.mesh.fabric_api import Fabric
from meshnode.mesh.local_caps import local_capabilities
from meshnode.mesh.runtime import Outbox, Publish, drain, find_held_model, load_limits
from meshnode.mesh.stage_control import ClaimLease, LoadLimits, LoadRequested, PrepareRequested, StopRequested
from meshnode.mesh.stage_control_server import StageServerControl
from meshnode.paths import NodePaths
from meshnode.state import PeerInfo, StageChanged, StageInfo, StageState
from meshnode.wire.messages import WHOLE_BATCH

__all__ = ["StageServerRuntime"]

log = logging.getLogger(__name__)

_REQUESTS = (wire.Claim, wire.Prepare, wire.Load, wire.Stop)
_DATA = (wire.Forward, wire.Trim, wire.SessionEnd, wire.GrammarMask, wire.SessionCopy)
PROGRESS_EVERY_S = 0.25
# How long a Load waits for an authenticated link to the next stage's node. A node that
# just joined (or came back) may be linked to the coordinator, which planned with it,
# before it is to this node; a step forwarded before then would be dropped and the
# request wait out its reply timeout. A Load that waits in vain fails with the reason, and
# the coordinator plans again.
LINK_WAIT_S = 15.0
LINK_POLL_S = 0.05


async def wait_for_peer(fabric: Fabric, node_id: str, within_s: float, poll_s: float = LINK_POLL_S) -> bool:
    """Whether ``node_id`` is an authenticated peer, waiting up to ``within_s`` for it."""
    deadline = time.monotonic() + within_s
    while not any(p.node_id == node_id and p.authenticated for p in fabric.peers()):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True


@dataclass(frozen=True, slots=True)
class _Claim:
    """Which assignment a piece of host work belongs to."""

    term: int
    coordinator: str
    start: int
    end: int


class StageServerRuntime:
    """Serves at most one stage of another node's model (see the module docstring).

    ``publish`` receives every :class:`StageChanged` (the node hands them to the UI).
    ``n_threads``: llama.cpp threads of the stage engine (None: every core).
    ``max_memory``: this node's budget in bytes (``--max-memory``; None: its free RAM),
    which a coordinator's Load parameters must fit. ``lease``: see :class:`ClaimLease`.
    ``shelf``: the node's :class:`EngineShelf`, shared with its coordinator (None: one of
    its own).
    """

    def __init__(self, fabric: Fabric, paths: NodePaths, *, n_threads: int | None = None,
                 decode_threads: int | None = None, gpu_layers: int = 0,
                 publish: Publish | None = None, max_memory: int | None = None,
                 lease: ClaimLease = ClaimLease(), shelf: EngineShelf | None = None) -> None:
        self.fabric = fabric
        self.paths = paths
        self.n_threads = n_threads
        self.decode_threads = decode_threads
        self.gpu_layers = gpu_layers   # this node's own setting, never the coordinator's
        self.publish = publish
        self.max_memory = max_memory
        # an engine freed by a re-plan is taken back by a Load of the same stage
        self.shelf = shelf if shelf is not None else EngineShelf()
        self.control = StageServerControl(fabric.node_id, time.monotonic(), name=fabric.name, lease=lease)
        self._timer = ControlTimer(self.control, time.monotonic, self._pump)
        self._outbox = Outbox(fabric, "stage-server-send")
        self._host: Any = None                 # StageHost while READY
        self._host_claim: _Claim | None = None
        self._slice: tuple[_Claim, Path, int] | None = None   # claim, slice path, n_layers_total
        self._pinned: Path | None = None       # the slice kept from the cache's eviction
        self._tasks: set[asyncio.Task] = set()
        self._frees: set[asyncio.Task] = set()
        self._last_progress = 0.0
        self.share: Any = None                 # ShareService: fetches what this node lacks
        fabric.on_peer_change(self._on_peer_change)

    # ---- reading -----------------------------------------------------------------

    def stages(self) -> list[StageInfo]:
        """The stage this node serves for another node (empty while idle), with what its
        engine computes on once loaded; a stopped or failed stage stays listed, with its
        reason, until the next claim."""
        st = self.control.stage
        if st is None:
            return []
        host = self._host
        return [host.worker.engine.describe(st) if host is not None else st]

    def served_threads(self) -> tuple[int, int]:
        """(threads now, most) of the CPU stage this node serves for a peer; (0, 0) when
        it serves none or on a GPU (what its capabilities tell the coordinator)."""
        return self._host.worker.engine.cpu_threads if self._host is not None else (0, 0)

    def sessions(self) -> list[int]:
        """Sessions whose KV this node holds for the stage it serves."""
        return sorted(self._host.sessions) if self._host is not None else []

    def busy_sessions(self, idle_s: float) -> list[int]:
        """Of :meth:`sessions`, those with a step or a copy in the last ``idle_s`` s (a
        coordinator's kept sessions for prefix reuse are idle: nothing waits for them)."""
        return self._host.busy_sessions(idle_s) if self._host is not None else []

    @property
    def holds_engine(self) -> bool:
        """True while a stage engine is loaded here (False once Stop freed it)."""
        return self._host is not None

    # ---- feeding -----------------------------------------------------------------

    def handle(self, node_id: str, msg: wire.Message) -> bool:
        """Take ``msg`` from ``node_id`` if it is for the stage server; False otherwise.

        Stage-control requests always are; Inventory only from the claiming coordinator
        (the other direction carries Inventory reports to a coordinator); data messages
        go to the stage host (a Forward with no stage here is answered with DataError).
        """
        if isinstance(msg, _DATA):
            self._on_data(node_id, msg)
            return True
        if isinstance(msg, wire.Inventory):
            if node_id != self.control.coordinator_id:
                return False
        elif not isinstance(msg, _REQUESTS):
            return False
        self.control.receive(node_id, msg, time.monotonic())
        self._pump()
        return True

    async def stop(self) -> None:
        """Node shutdown: the same as :meth:`close`."""
        await self.close()

    async def close(self) -> None:
        """Free the engine and stop every task (node shutdown)."""
        self._timer.cancel()
        for t in list(self._tasks):
            t.cancel()
        await self._free("node stopping")
        await self.shelf.close()
        for t in list(self._frees):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await t
        await self._outbox.flush()
        await self._outbox.close()

    async def wait_idle(self) -> None:
        """Wait until no host work (prepare, load, free) is running (tests)."""
        while self._tasks or self._frees:
            await asyncio.gather(*self._tasks, *self._frees, return_exceptions=True)

    # ---- the pump ----------------------------------------------------------------

    def _pump(self) -> None:
        for ev in drain(self.control, self._outbox):
            match ev:
                case StageChanged(stage=st):
                    if self.publish is not None:
                        self.publish(ev)
                    if st.state in (StageState.FAILED, StageState.STOPPED):
                        self._pin(None)
                        if self._host is not None:
                            self._spawn_free(st.detail or st.state.value)
                case PrepareRequested():
                    self._spawn(self._prepare(ev, self._claim()), "stage-prepare")
                case LoadRequested():
                    self._spawn(self._load(ev, self._claim()), "stage-load")
                case StopRequested(reason=reason):
                    self._spawn_free(reason)
                case _:
                    log.debug("stage server: %r", ev)
        self._timer.arm()

    def _claim(self) -> _Claim:
        c = self.control
        return _Claim(c.term, c.coordinator_id or "", c.layer_start, c.layer_end)

    def _current(self, claim: _Claim, state: StageState) -> bool:
        return self.control.state is state and self._claim() == claim

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _spawn_free(self, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(self._free(reason), name="stage-free")
        self._frees.add(task)
        task.add_done_callback(self._frees.discard)

    # ---- host work -----------------------------------------------------------------

    async def _prepare(self, ev: PrepareRequested, claim: _Claim) -> None:
        from meshnode.models.slicer import SliceCache, unpin

        c = self.control
        try:
            model = await asyncio.to_thread(find_held_model, self.paths, ev.model_sha256)
            if model is None:
                path = await self._fetch(ev, claim)
                if not self._current(claim, StageState.PREPARING):
                    unpin(path)
                    return
                self._pin(path)
                limits = await asyncio.to_thread(self._limits, path, path, ev.layer_start, ev.layer_end,
                                                 ev.n_layers_total)
                self._slice = (claim, Path(path), ev.n_layers_total)
                c.slice_present(limits, time.monotonic())
                self._pump()
                return
            if model.n_layers != ev.n_layers_total:
                raise MeshnodeError(f"the stored model has {model.n_layers} layers, "
                                    f"the coordinator's has {ev.n_layers_total}")
            loop = asyncio.get_running_loop()

            def progress(phase: str, done: int, total: int | None) -> None:  # worker thread
                if total:
                    loop.call_soon_threadsafe(self._progress, claim, done / total)

            path = await asyncio.to_thread(SliceCache(self.paths).get, model, ev.layer_start,
                                           ev.layer_end, progress=progress, pin=True)
            if not self._current(claim, StageState.PREPARING):
                unpin(path)   # stopped or re-claimed meanwhile
                return
            self._pin(path)
            limits = await asyncio.to_thread(self._limits, model.path, path, ev.layer_start, ev.layer_end)
        except asyncio.CancelledError:
            raise
        except (MeshnodeError, OSError) as exc:
            if self._current(claim, StageState.PREPARING):
                c.slice_failed(str(exc))
                self._pump()
            return
        if self._current(claim, StageState.PREPARING):
            self._slice = (claim, Path(path), ev.n_layers_total)
            c.slice_present(limits, time.monotonic())
            self._pump()

    async def _fetch(self, ev: PrepareRequested, claim: _Claim) -> Path:
        """The layer package of the claim's range, from the slice cache or from the peers
        that share the model (pinned either way)."""
        from meshnode.models.slicer import SliceCache, unpin
        from meshnode.models.transfer import TransferError

        cache = SliceCache(self.paths)
        args = (ev.model_sha256, ev.layer_start, ev.layer_end, ev.n_layers_total)
        path = await asyncio.to_thread(cache.lookup, *args, pin=True)
        if path is not None:
            return path
        sources = self.share.sources_for(ev.model_sha256) if self.share is not None else []
        if not sources:
            raise MeshnodeError(
                f"model {ev.model_name or '?'} (sha256 {ev.model_sha256[:12]}...) is not in the "
                f"store of {self.fabric.name} and no peer shares it")
        dest = cache.package_path(*args)

        def progress(p: Any) -> None:
            self._progress(claim, p.done / max(p.total, 1), f"fetching layers {p.describe()}")

        try:
            _, name = await self.share.pull(ev.model_sha256, dest, sources=sources, whole=False,
                                            layer_start=ev.layer_start, layer_end=ev.layer_end,
                                            name=ev.model_name, progress=progress)
        except TransferError as exc:
            raise MeshnodeError(f"cannot fetch layers [{ev.layer_start}, {ev.layer_end}) of "
                                f"{ev.model_name or ev.model_sha256[:12]}: {exc}") from None
        await asyncio.to_thread(cache.adopt, dest, ev.model_sha256, name, ev.layer_start, ev.layer_end,
                                ev.n_layers_total)
        path = await asyncio.to_thread(cache.lookup, *args, pin=True)
        if path is None:
            unpin(dest)
            raise MeshnodeError("the fetched layer package vanished from the slice cache")
        return path

    def _pin(self, path: Path | None) -> None:
        """Keep ``path`` (the slice of the current claim) pinned, and only it."""
        from meshnode.models.slicer import unpin

        old, self._pinned = self._pinned, path
        if old is not None:
            unpin(old)

    def _limits(self, model_path: Path, slice_path: Path, start: int, end: int,
                n_layers_total: int | None = None) -> LoadLimits:
        """What a Load may ask for here (blocking: reads the GGUF header, /proc/meminfo)."""
        # a parked engine's memory is free for this Load: reused as it is, or freed first
        budget = (self.max_memory if self.max_memory is not None
                  else local_capabilities().free_ram_bytes + self.shelf.held_bytes())
        return load_limits(model_path, slice_path, start, end, budget_bytes=budget, n_layers_total=n_layers_total)

    def _progress(self, claim: _Claim, fraction: float, detail: str | None = None) -> None:
        now = time.monotonic()
        if now - self._last_progress < PROGRESS_EVERY_S and fraction < 1.0:
            return
        self._last_progress = now
        if self._current(claim, StageState.PREPARING) and not self.control.present:
            self.control.slice_progress(fraction, detail or f"slicing {fraction:.0%}")
            self._pump()

    async def _load(self, ev: LoadRequested, claim: _Claim) -> None:
        from meshnode.engine import EngineError, EngineConfig
        from meshnode.mesh.stage_host import StageHost, StageRoute

        c = self.control
        t0 = time.perf_counter()
        host = None
        try:
            if ev.downstream and not await wait_for_peer(self.fabric, ev.downstream, LINK_WAIT_S):
                raise MeshnodeError(f"no link to {ev.downstream}, the next stage's node, "
                                    f"within {LINK_WAIT_S:g} s")
            if self._slice is None or self._slice[0] != claim:
                raise MeshnodeError("no prepared slice for this load")
            _, path, n_total = self._slice
            p = ev.params
            config = EngineConfig(path, takes_tokens=ev.layer_start == 0, has_head=ev.layer_end == n_total,
                                  n_ctx=p.n_ctx, n_batch=p.n_batch, n_seq_max=p.n_seq_max, kv_type=p.kv_type,
                                  n_threads=self.n_threads, decode_threads=self.decode_threads,
                                  gpu_layers=self.gpu_layers)
            limits = c.limits
            worker = await self.shelf.load(config, f"stage{ev.stage_index}",
                                           held_bytes=limits.need_bytes(p) if limits is not None else 0)
            host = StageHost(self.fabric, worker,
                             StageRoute(ev.coordinator, ev.downstream or None, p.wire_dtype, ev.upstream))
        except asyncio.CancelledError:
            raise
        except (EngineError, MeshnodeError, OSError) as exc:
            if self._current(claim, StageState.LOADING):
                c.load_failed(str(exc))
                self._pump()
            return
        if not self._current(claim, StageState.LOADING):
            await host.close()   # stopped or re-claimed while loading: free at once
            return
        if self._host is not None:   # cannot happen (one stage at a time); never leak it
            self._spawn_free("replaced")
        self._host, self._host_claim = host, claim
        if not c.loaded(worker.engine.n_embd, (time.perf_counter() - t0) * 1000.0):
            self._spawn_free("stopped while loading")
        self._pump()

    async def _free(self, reason: str) -> None:
        host, self._host, self._host_claim = self._host, None, None
        if host is not None:
            log.info("stage server %s: freeing the stage engine (%s)", self.fabric.name, reason)
            await host.close()

    # ---- data plane and peers ---------------------------------------------------------

    def _on_data(self, node_id: str, msg: wire.Message) -> None:
        if self._host is not None and self.control.state is StageState.READY:
            self._host.accept(node_id, msg)
            return
        if isinstance(msg, wire.Forward):
            reply = wire.DataError(ref=0, batch_id=msg.batch_id, session=WHOLE_BATCH,
                                   code=wire.ErrorCode.NO_SUCH_SESSION,
                                   message=f"{self.fabric.name} serves no stage now")
            task = asyncio.get_running_loop().create_task(self._send_data(node_id, reply))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send_data(self, node_id: str, msg: wire.Message) -> None:
        from meshnode.mesh.stage_host import DATA_STREAM

        with contextlib.suppress(Exception):
            await self.fabric.send_data(node_id, msg, DATA_STREAM)

    def _on_peer_change(self, node_id: str, info: PeerInfo | None, reason: str) -> None:
        c = self.control
        if info is None and node_id == c.coordinator_id and c.state in (
                StageState.ASSIGNED, StageState.PREPARING, StageState.LOADING, StageState.READY):
            c.fail(f"coordinator {node_id} lost: {reason}")
            self._pump()
