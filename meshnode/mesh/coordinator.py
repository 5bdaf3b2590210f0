"""The asyncio driver of :class:`CoordinatorControl`: starting a model over the mesh.

Theory of operation. The node that coordinates a model (stage 0) runs one
:class:`CoordinatorRuntime`. :meth:`CoordinatorRuntime.start_model`:

1. resolves the model and reads its shape from the GGUF (:func:`model_shape`);
2. gathers candidates: this node (free RAM under ``--max-memory``) and the peers whose
   capabilities list the model's sha256 (for an explicit plan every peer, so a named
   node that lacks the model fails with its own reason); plans (``--split``,
   ``--stages`` or automatic);
3. takes a new term from :class:`TermStore` and runs :class:`CoordinatorControl`: its
   messages go out through an :class:`Outbox`, replies come back through
   :meth:`CoordinatorRuntime.handle`, its one timer is re-armed after every feed. Stage
   0's slice is built while the remote stages negotiate; on ``LocalLoadRequested`` the
   engine is opened and ``local_stage_ready()`` called;
4. on ``PlanReady`` returns a :class:`ServingModel` whose ``pipeline`` is a
   :class:`LocalPipeline` (one stage: the whole model) or a :class:`MeshPipeline`; on
   ``PlanFailed`` frees stage 0 and raises :class:`NegotiationError` with the reason.

After PlanReady, a stage failure (a failure report, or the loss of a stage node's link)
fails the plan: the runtime's ``on_lost`` hook hears of it first (the model service
re-plans, :mod:`meshnode.mesh.replan`, and requests in flight wait for the new route),
then waiting pipeline steps fail at once (``pipeline.fail_all``) and the stages show
FAILED / STOPPED. ``on_joined`` hears of every peer that authenticates. :meth:`ServingModel.stop` sends Stop to every stage,
waits briefly for their answers and frees stage 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from meshnode import wire
from meshnode.engine.shelf import EngineShelf
from meshnode.errors import MeshnodeError
from meshnode.limits import gpu_pad_rows
from meshnode.mesh.control_timer import ControlTimer
from meshnode.mesh.fabric_api import Fabric
from meshnode.mesh.local_caps import local_capabilities
from meshnode.mesh.planner import Candidate, Plan, PlanError, plan as make_plan
from meshnode.mesh.runtime import (
    NegotiationError, Outbox, Publish, ServeOptions, TermStore, drain, load_limits, model_shape, trained_context,
)
from meshnode.mesh.stage_control import LoadParams, LocalLoadRequested, PlanFailed, PlanReady
from meshnode.mesh.stage_control_coordinator import CoordinatorControl, CoordinatorState
from meshnode.paths import NodePaths
from meshnode.state import StageChanged, StageInfo, StageState

__all__ = ["CoordinatorRuntime", "ServingModel"]

log = logging.getLogger(__name__)

_REPLIES = (wire.Status, wire.Inventory, wire.Ready, wire.Error)
# What the planner assumes a peer lacking the model fetches its layers at until it has
# pulled something and advertises its measured rate (a 1 Gbit/s LAN, docs/models.md): it
# makes holders win over non-holders, never rules a non-holder out.
FETCH_BYTES_PER_S = 110e6


class ServingModel:
    """One model started by this coordinator: its plan, pipeline and stages.

    ``pipeline`` is set once the plan is READY. ``state`` is the plan's
    :class:`CoordinatorState`; ``failure`` the reason once it failed.
    """

    def __init__(self, runtime: "CoordinatorRuntime", model: Any, plan: Plan, term: int,
                 options: ServeOptions) -> None:
        self.runtime = runtime
        self.model = model
        self.plan = plan
        self.term = term
        self.options = options
        self.pipeline: Any = None
        self.failure: str | None = None
        self._loop = asyncio.get_running_loop()
        self._outbox = Outbox(runtime.fabric, "coordinator-send")
        self._ready: asyncio.Future = self._loop.create_future()
        self._worker: Any = None                    # stage 0's engine worker
        self._pinned: Any = None                    # stage 0's slice, pinned in the slice cache
        self._tasks: set[asyncio.Task] = set()
        self._stop_waiting: set[str] = set()
        self._stopped = asyncio.Event()
        self._stage_nodes = {s.node_id for s in plan.stages[1:]}
        self._slice_task = self._spawn(self._local_slice(), "stage0-slice")
        self.control = CoordinatorControl(
            plan, term=term, model_sha256=model.sha256, model_name=model.name, n_layers=model.n_layers,
            load=LoadParams(options.n_ctx, options.n_batch, options.n_seq_max, options.wire_dtype),
            now=self._loop.time(), timeouts=options.timeouts,
        )
        self._timer = ControlTimer(self.control, self._loop.time, self._pump)
        self._pump()

    # ---- reading -----------------------------------------------------------------

    def stages(self) -> list[StageInfo]:
        """Every stage of the plan as the UI and ``meshnode status --json`` show it, with
        the backend each runs on and, on a CPU, its threads: stage 0's from its loaded
        engine, a peer's as its capabilities advertise them over the authenticated link."""
        caps = {p.node_id: p.capabilities for p in self.runtime.fabric.peers()}
        out = []
        for st in self.control.stages:
            if st.index == 0:
                st = dataclasses.replace(st, gpu_pad_rows=gpu_pad_rows())
                out.append(self._worker.engine.describe(st) if self._worker is not None else st)
            else:
                c = caps.get(st.node_id)
                if c is None:
                    out.append(st)
                    continue
                threads, most = c.stage_threads if c.backend == "cpu" else (0, 0)
                out.append(dataclasses.replace(st, backend=c.backend, gpu_pad_rows=c.gpu_pad_rows,
                                               threads=threads, max_threads=most))
        return out

    @property
    def state(self) -> CoordinatorState:
        return self.control.state

    def has_stage_node(self, node_id: str) -> bool:
        return node_id in self._stage_nodes

    # ---- commands ------------------------------------------------------------------

    async def wait_ready(self) -> "ServingModel":
        """Wait for PlanReady; raises :class:`NegotiationError` on PlanFailed."""
        await asyncio.shield(self._ready)
        return self

    async def stop(self, reason: str = "stopped", timeout: float | None = None) -> None:
        """Stop every stage and free stage 0's engine (idempotent).

        Waits up to ``timeout`` s (default ``options.stop_timeout``; node shutdown
        passes less) for each reachable stage to answer ``Status(stopped)`` (its host
        then frees the engine)."""
        if self.control.state is not CoordinatorState.STOPPED:
            reachable = {p.node_id for p in self.runtime.fabric.peers()}
            # Stages already FAILED / STOPPED were sent Stop when the plan failed.
            self._stop_waiting = {s.node_id for s in self.control.stages[1:]
                                  if s.state not in (StageState.FAILED, StageState.STOPPED)
                                  and s.node_id in reachable}
            self.control.stop(reason)
            self._pump()
            if not self._ready.done():
                self._ready.set_exception(NegotiationError(f"stopped: {reason}"))
                self._ready.exception()  # retrieved: nobody may be waiting
            await self._free_local(f"model stopped: {reason}")
            if self._stop_waiting:
                self._stopped.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(),
                                           self.options.stop_timeout if timeout is None else timeout)
        for t in list(self._tasks):
            t.cancel()
        self._timer.cancel()
        await self._outbox.flush()
        await self._outbox.close()
        self.runtime._forget(self)  # noqa: SLF001 - our owner

    # ---- feeding -----------------------------------------------------------------

    def receive(self, node_id: str, msg: wire.Message) -> None:
        if (self.control.state is CoordinatorState.STOPPED and isinstance(msg, wire.Status)
                and msg.state is wire.StageStatus.STOPPED and msg.term == self.term):
            self._stop_waiting.discard(node_id)
            if not self._stop_waiting:
                self._stopped.set()
            return
        self.control.receive(node_id, msg, self._loop.time())
        self._pump()

    def peer_lost(self, node_id: str, reason: str) -> None:
        if node_id in self._stop_waiting:
            self._stop_waiting.discard(node_id)
            if not self._stop_waiting:
                self._stopped.set()
        self.control.stage_lost(node_id, f"link lost: {reason}", self._loop.time())
        self._pump()

    # ---- the pump ----------------------------------------------------------------

    def _pump(self) -> None:
        for ev in drain(self.control, self._outbox):
            match ev:
                case StageChanged():
                    if self.runtime.publish is not None:
                        self.runtime.publish(ev)
                case LocalLoadRequested():
                    self._spawn(self._load_local(ev), "stage0-load")
                case PlanReady():
                    self._on_ready()
                case PlanFailed(reason=reason, stage_index=index):
                    self._on_failed(reason, index)
        self._timer.arm()

    def _on_ready(self) -> None:
        from meshnode.mesh.pipeline import LocalPipeline, MeshPipeline

        if self.plan.n_stages == 1:
            self.pipeline = LocalPipeline(self._worker)
        else:
            self.pipeline = MeshPipeline(self._worker, self.runtime.fabric,
                                         [s.node_id for s in self.plan.stages[1:]],
                                         wire_dtype=self.options.wire_dtype)
        log.info("model %s ready on %d stage(s) (term %d)", self.model.name, self.plan.n_stages, self.term)
        if not self._ready.done():
            self._ready.set_result(self)

    def _on_failed(self, reason: str, index: int | None) -> None:
        self.failure = reason
        log.warning("model %s: %s", self.model.name, reason)
        if self.pipeline is not None and self.runtime.on_lost is not None:
            # Before the waiting steps fail: their requests must find the model recovering.
            node = self.plan.stages[index].node_id if index is not None and 0 < index < self.plan.n_stages else None
            self.runtime.on_lost(self, reason, node)
        if self.pipeline is not None and hasattr(self.pipeline, "fail_all"):
            self.pipeline.fail_all(reason)
        if not self._ready.done():
            self._ready.set_exception(NegotiationError(reason, index))
        self._spawn(self._free_local(f"model failed: {reason}"), "stage0-free")

    # ---- stage 0 -------------------------------------------------------------------

    def _spawn(self, coro: Any, name: str) -> asyncio.Task:
        task = self._loop.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _local_slice(self) -> Any:
        from meshnode.models.slicer import SliceCache

        end = self.plan.stages[0].end
        path = await asyncio.to_thread(SliceCache(self.runtime.paths).get, self.model, 0, end, pin=True)
        self._pinned = path   # kept from the cache's eviction until stage 0 is freed
        return path

    async def _load_local(self, ev: LocalLoadRequested) -> None:
        from meshnode.engine import EngineError, EngineConfig

        t0 = time.perf_counter()
        p = ev.params
        try:
            path = await self._slice_task
            config = EngineConfig(path, takes_tokens=True, has_head=ev.layer_end == self.model.n_layers,
                                  n_ctx=p.n_ctx, n_batch=p.n_batch, n_seq_max=p.n_seq_max,
                                  kv_type=p.kv_type, n_threads=self.runtime.n_threads,
                                  decode_threads=self.runtime.decode_threads,
                                  gpu_layers=self.runtime.gpu_layers)
            need = await asyncio.to_thread(self._need_bytes, path, ev)
            worker = await self.runtime.shelf.load(config, "stage0", held_bytes=need)
        except asyncio.CancelledError:
            raise
        except (EngineError, MeshnodeError, OSError) as exc:
            self.control.local_stage_failed(f"stage 0: {exc}", self._loop.time())
            self._pump()
            return
        self._worker = worker
        if not self.control.local_stage_ready(worker.engine.n_embd, (time.perf_counter() - t0) * 1000.0,
                                              self._loop.time()):
            await self._free_local("stopped while loading")
        self._pump()

    def _need_bytes(self, path: Any, ev: LocalLoadRequested) -> int:
        """The memory estimate of stage 0 (blocking: the GGUF header, parsed once)."""
        return load_limits(self.model.path, path, ev.layer_start, ev.layer_end,
                           budget_bytes=None).need_bytes(ev.params)

    async def _free_local(self, reason: str = "stopped") -> None:
        from meshnode.models.slicer import unpin

        worker, self._worker = self._worker, None
        pinned, self._pinned = self._pinned, None
        unpin(pinned)
        if self.pipeline is not None:
            # Fails waiting steps and closes the worker; later runs raise
            # PipelineUnavailableError(reason). Idempotent.
            await self.pipeline.close(reason)
        elif worker is not None:
            await worker.close()


class CoordinatorRuntime:
    """Starts and stops the model this node coordinates (see the module docstring).

    The node's dispatcher calls :meth:`handle` for every message; ``publish`` receives
    each :class:`StageChanged`. ``n_threads``: llama.cpp threads of stage 0. ``shelf``: the
    node's :class:`EngineShelf`, shared with its stage server (None: one of its own).
    """

    def __init__(self, fabric: Fabric, paths: NodePaths, *, n_threads: int | None = None,
                 decode_threads: int | None = None, gpu_layers: int = 0,
                 publish: Publish | None = None, shelf: EngineShelf | None = None) -> None:
        self.fabric = fabric
        self.paths = paths
        # stage 0's engine freed by a re-plan is taken back by the next plan's stage 0 of
        # the same range
        self.shelf = shelf if shelf is not None else EngineShelf()
        self.n_threads = n_threads
        self.decode_threads = decode_threads
        self.gpu_layers = gpu_layers   # this node's own setting, never the coordinator's
        self.publish = publish
        self.terms = TermStore(paths)
        self._serving: ServingModel | None = None
        # Hooks of the model service: a READY plan lost a stage (serving model, reason,
        # the lost stage's node or None); a peer authenticated (its node id).
        self.on_lost: Callable[[ServingModel, str, str | None], None] | None = None
        self.on_joined: Callable[[str], None] | None = None
        fabric.on_peer_change(self._on_peer_change)

    # ---- reading -----------------------------------------------------------------

    @property
    def serving(self) -> ServingModel | None:
        """The model this node coordinates (ready, negotiating or failed), or None."""
        return self._serving

    def stages(self) -> list[StageInfo]:
        return self._serving.stages() if self._serving is not None else []

    # ---- commands ------------------------------------------------------------------

    async def start_model(self, model_ref: Any, options: ServeOptions | None = None, *,
                          exclude: frozenset[str] = frozenset(), keep: Plan | None = None) -> ServingModel:
        """Plan, negotiate and load ``model_ref`` (a ModelRef, or a name / path for
        :func:`resolve_model`); returns the READY :class:`ServingModel`.

        Raises :class:`PlanError` (no plan fits: what is missing),
        :class:`NegotiationError` (a stage failed: which and why; every stage was told to
        stop), model-store errors, or :class:`MeshnodeError` when a model is already being
        served (stop it first). A model that failed earlier is stopped and replaced.
        ``exclude``: nodes not to plan on (a stage that just failed there); ``keep``: a
        plan whose layer ranges to keep where it can (:func:`meshnode.mesh.replan.substitute`).
        """
        options = options or ServeOptions()
        if self._serving is not None:
            if self._serving.state in (CoordinatorState.NEGOTIATING, CoordinatorState.READY):
                raise MeshnodeError(f"already serving {self._serving.model.name}; stop it first")
            await self._serving.stop("replaced")
        model = model_ref
        if isinstance(model_ref, str) or model_ref is None:
            from meshnode.models.store import resolve_model

            model = await asyncio.to_thread(resolve_model, model_ref, self.paths)
        the_plan, options = await self.plan_for(model, options, exclude=exclude, keep=keep)
        log.info("plan for %s (%s):\n%s", model.name, the_plan.reason, the_plan.describe())
        term = self.terms.next_term()
        sm = ServingModel(self, model, the_plan, term, options)
        self._serving = sm
        try:
            return await sm.wait_ready()
        except NegotiationError:
            await sm.stop("negotiation failed")
            raise
        except asyncio.CancelledError:
            await sm.stop("cancelled")
            raise

    async def plan_for(self, model: Any, options: ServeOptions, *, exclude: frozenset[str] = frozenset(),
                       keep: Plan | None = None) -> tuple[Plan, ServeOptions]:
        """The plan for ``model`` (a ModelRef) over the current peers, and ``options``
        with ``n_ctx`` capped at the model's trained context (raises :class:`PlanError`).
        With ``keep`` (and no explicit layout), ``keep`` with its lost stages moved to
        other nodes, when they fit."""
        # (the GGUF's header is parsed once: a re-plan reads it again from runtime's cache)
        n_ctx_train = await asyncio.to_thread(trained_context, model.path)
        n_ctx = min(options.n_ctx, n_ctx_train) if n_ctx_train else options.n_ctx
        shape = await asyncio.to_thread(model_shape, model.path, n_ctx, overhead_bytes=options.stage_overhead)
        if n_ctx_train and options.n_ctx > n_ctx_train:
            # Stage servers refuse a Load above the trained context: ask for what they take.
            log.warning("n_ctx %d is above %s's trained context of %d tokens: using %d",
                        options.n_ctx, model.name, n_ctx_train, n_ctx_train)
            options = dataclasses.replace(options, n_ctx=n_ctx_train)
        if keep is not None and options.explicit is None:
            from meshnode.mesh.replan import substitute

            kept = substitute(keep, self._candidates(model, options, exclude)[0])
            if kept is not None:
                return kept, options
        return self.make_plan(model, shape, options, exclude=exclude), options

    def make_plan(self, model: Any, shape: Any, options: ServeOptions, *,
                  exclude: frozenset[str] = frozenset()) -> Plan:
        """The plan for ``model`` over the current peers but ``exclude`` (raises
        :class:`PlanError`)."""
        cands, skipped = self._candidates(model, options, exclude)
        try:
            return make_plan(shape, cands, split=options.split, explicit=options.explicit)
        except PlanError as exc:
            if not skipped:
                raise
            raise PlanError(f"{exc} ({len(skipped)} peer(s) left out because they do not hold "
                            f"{model.name}: {', '.join(sorted(skipped))})") from None

    def _candidates(self, model: Any, options: ServeOptions,
                    exclude: frozenset[str]) -> tuple[list[Candidate], list[str]]:
        """This node and the peers that hold ``model`` (every peer for an explicit plan)
        but ``exclude``; and the names of the peers left out for lacking the model."""
        me = local_capabilities()
        # (a parked engine's memory is free to the plan: reused as it is, or freed first)
        cands = [Candidate(self.fabric.node_id, self.fabric.name, me.free_ram_bytes + self.shelf.held_bytes(),
                           budget=options.max_memory, speed=me.speed or None, is_coordinator=True,
                           free_vram=me.free_vram_bytes + self.shelf.held_vram() if self.gpu_layers != 0 else 0)]
        skipped = []
        peers = [p for p in self.fabric.peers() if p.node_id not in exclude]
        # a peer that lacks the model fetches its layers from one that shares it (this node too)
        mine = getattr(self.fabric, "capabilities", {}).get("models", [])
        sharers = any(m.get("sha256") == model.sha256 and m.get("shared") for m in mine if isinstance(m, dict))
        sharers = sharers or any(p.capabilities is not None and any(
            m.sha256 == model.sha256 and m.shared for m in p.capabilities.models) for p in peers)
        for p in peers:
            caps = p.capabilities
            holds = caps is not None and any(m.sha256 == model.sha256 for m in caps.models)
            if not holds and not sharers and options.explicit is None:
                skipped.append(p.name or p.node_id)
                continue
            cands.append(Candidate(p.node_id, p.name or p.node_id, caps.free_ram_bytes if caps else 0,
                                   speed=(caps.speed or None) if caps else None, rtt_ms=p.rtt_ms,
                                   fetch_bytes_per_s=None if holds else (
                                       (caps.fetch_bytes_per_s if caps else 0) or FETCH_BYTES_PER_S),
                                   free_vram=caps.free_vram_bytes if caps and caps.backend != "cpu" else 0))
        return cands, skipped

    async def stop(self, reason: str = "stopped") -> None:
        """Stop the model this node coordinates, if any."""
        if self._serving is not None:
            await self._serving.stop(reason)

    async def close(self) -> None:
        """Node shutdown: stop the model (Stop to every stage, free stage 0)."""
        await self.stop("node stopping")
        await self.shelf.close()

    # ---- feeding -----------------------------------------------------------------

    def handle(self, node_id: str, msg: wire.Message) -> bool:
        """Take ``msg`` if it is for the model this node coordinates; False otherwise.

        Stage-control answers (Status, Inventory, Ready, Error) from a node of the
        plan, and TokenReturn / DataError for the mesh pipeline."""
        sm = self._serving
        if sm is None or not sm.has_stage_node(node_id):
            return False
        if isinstance(msg, (wire.TokenReturn, wire.DataError)):
            pipe = sm.pipeline
            return bool(pipe is not None and hasattr(pipe, "on_data") and pipe.on_data(node_id, msg))
        if not isinstance(msg, _REPLIES):
            return False
        sm.receive(node_id, msg)
        return True

    def _on_peer_change(self, node_id: str, info: Any, reason: str) -> None:
        if info is not None:
            if self.on_joined is not None:
                self.on_joined(node_id)
            return
        sm = self._serving
        if sm is not None and sm.has_stage_node(node_id):
            sm.peer_lost(node_id, reason)

    def _forget(self, sm: ServingModel) -> None:
        if self._serving is sm:
            self._serving = None
