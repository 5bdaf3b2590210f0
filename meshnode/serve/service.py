"""The model this node coordinates: fetch, plan, load, then serve it over /v1.

Theory of operation: :class:`ModelService` runs in the node's event loop. ``start()``
returns at once and the work happens in a task, so the node's HTTP port answers
``/health`` while a model downloads or loads; ``/v1`` answers 503 (with the reason)
until the model is ready. Steps: resolve the model (the default one is fetched on first
run, with progress shown as a transfer), read its tokenizer, resolve the speculative
strategy (CLI > config > model package > built-in), plan the stages over the mesh and
negotiate them (:mod:`meshnode.mesh.runtime`), then hand a
:class:`~meshnode.serve.model_server.ModelServer` to the OpenAI routes.

Failover: when a READY plan loses a stage (its node's link died, or the stage reported a
failure), the coordinator tells the service before any waiting step fails. The service
marks the model server's route down (requests in flight wait, new ones too), goes
RECOVERING, stops the old plan's stages and re-plans on the members that remain
(:func:`meshnode.mesh.replan.fallback_options`: the original options, then fewer stages,
then the planner's choice, which may be this node alone). On success the server switches
to the new pipeline and its requests replay their sessions there; with no plan they end
with a 503 that says why, and the model is FAILED until a member joins. A model serving
on a fallback plan is *degraded*: when a member joins, the service plans again with the
original options and, if that changes the route, switches once no request is in flight.
Each re-plan is a :class:`~meshnode.state.FailoverInfo` (``status``, the TUI).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from meshnode.errors import MeshnodeError
from meshnode.gguf_files import model_size
from meshnode.serve.client import GenerationEvent, GenerationRequest, ModelCard
from meshnode.serve.errors import EngineUnavailableError
from meshnode.serve.http_guard import DEFAULT_MAX_QUEUE
from meshnode.state import FailoverInfo, ModelInfo, ModelReplanned, ModelStatus, TransferInfo

log = logging.getLogger(__name__)

RECENT_FAILOVERS = 20
# After a member joins, how often and how long to look for a better plan: its Hello may
# not list the model yet (capabilities follow once its store is read).
UPGRADE_POLL_S = 1.0
UPGRADE_TRIES = 10
# Stopping the lost plan's surviving stages waits at most this long for their answers:
# requests wait for the new route meanwhile.
REPLAN_STOP_TIMEOUT_S = 1.0
# A start-up phase (fetch, hash) logs its progress only once it has run this long.
PROGRESS_LOG_AFTER_S = 1.0


@dataclass(frozen=True)
class ServiceOptions:
    """What `meshnode serve` / `meshnode run` was asked to coordinate."""

    model: str | None = None            # None: the default model
    split: int | None = None            # force N stages
    stages: str | None = None           # explicit "node=0:10,node2=10:30"
    max_memory: int | None = None       # bytes this node may use (also advertised)
    n_ctx: int = 2048                   # per request
    n_batch: int = 64                   # prefill chunk, every stage
    parallel: int = 4                   # concurrent requests (sequence slots)
    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting beyond parallel (then 429)
    prefix_cache: int | None = None     # finished sessions kept for prefix reuse (None: parallel - 1)
    wire_dtype: str = "f32"
    threads: int | None = None
    gpu_layers: int = -1                # engine.offload.GPU_LAYERS_AUTO
    aliases: tuple[str, ...] = ()
    wait_peers: float = 30.0            # seconds to wait for peers a plan needs
    spec_cli: object | None = None      # meshnode.spec.strategy.CliSpecOptions
    config: object | None = None        # meshnode.config.MeshnodeConfig


class UnavailableClient:
    """The EngineClient while no model is ready: every request gets a 503 with why."""

    def __init__(self, reason: Callable[[], str]) -> None:
        self._reason = reason

    def models(self) -> list[ModelCard]:
        return []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        raise EngineUnavailableError(self._reason())
        yield  # pragma: no cover - makes this an async generator


class ModelService:
    def __init__(self, node, options: ServiceOptions) -> None:
        self.node = node
        self.options = options
        self.state = ModelStatus.STARTING
        self.detail = ""
        self.model_ref = None
        self.server = None       # ModelServer once ready
        self.serving = None      # the runtime's ServingModel (plan, stages, stop)
        self._transfers: dict[str, TransferInfo] = {}
        self._task: asyncio.Task | None = None
        self._base = None           # the runtime ServeOptions the model was started with
        self._first_plan = None     # the plan the model started on (a rejoin returns to it)
        self._degraded = False      # serving on a fallback plan (or on none)
        self._replan: asyncio.Task | None = None    # a re-plan under way
        self._upgrade: asyncio.Task | None = None   # looking for a better plan after a join
        self._failovers: deque[FailoverInfo] = deque(maxlen=RECENT_FAILOVERS)
        self._unavailable = UnavailableClient(lambda: f"model not ready: {self.state}"
                                              + (f" ({self.detail})" if self.detail else ""))

    @property
    def engine_client(self):
        return self.server if self.server is not None else self._unavailable

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="model-service")

    async def wait_ready(self, timeout: float | None = None) -> None:
        if self._task is not None:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)

    # ---- the start-up sequence --------------------------------------------------------

    def _progress(self, what: str) -> Callable[[str, int, int | None], None]:
        loop = asyncio.get_running_loop()

        logged: dict[str, int] = {}
        started: dict[str, float] = {}

        def hook(phase: str, done: int, total: int | None) -> None:
            info = TransferInfo(what, done, total or 0, phase)   # (shown as "{phase} {what}")
            loop.call_soon_threadsafe(self._transfers.__setitem__, what, info)
            # Headless users see progress in the log, every 10 %, once a phase has run for
            # PROGRESS_LOG_AFTER_S: hashing a small model (60 ms) logged eleven lines.
            if total and time.monotonic() - started.setdefault(phase, time.monotonic()) >= PROGRESS_LOG_AFTER_S:
                tenth = min(10, 10 * done // total)
                if tenth > logged.get(phase, -1):
                    logged[phase] = tenth
                    log.info("%s: %s %d%% (%.1f of %.1f MB)", what, phase, 10 * tenth, done / 1e6, total / 1e6)
        return hook

    async def _run(self) -> None:
        from meshnode.engine.tokenizer import Tokenizer
        from meshnode.models.store import resolve_model
        from meshnode.serve.model_server import ModelServer, ServeSettings

        o = self.options
        try:
            self._set(ModelStatus.FETCHING, o.model or "default model")
            ref = await asyncio.to_thread(resolve_model, o.model, self.node.paths,
                                          progress=self._progress(o.model or "default model"), allow_url=True)
            self._transfers.clear()
            self.model_ref = ref
            self.node.advertise_models()
            tokenizer = await asyncio.to_thread(Tokenizer, ref.path)
            spec = self._spec_config(ref)
            draft = await self._load_draft(spec, ref) if spec is not None else None
            self._set(ModelStatus.PLANNING, "")
            from meshnode.mesh.runtime import ServeOptions

            self._base = ServeOptions(
                split=o.split, explicit=o.stages, max_memory=o.max_memory, n_ctx=o.n_ctx,
                n_batch=o.n_batch, n_seq_max=o.parallel, wire_dtype=o.wire_dtype)
            serving = await self._plan_and_load(ref, self._base)
            self.serving = serving
            self._first_plan = serving.plan
            self.server = ModelServer(
                # (the context the stages were loaded with: --ctx, at most the model's trained context)
                ServeSettings(ref.name, n_ctx=serving.options.n_ctx, n_batch=o.n_batch, parallel=o.parallel, max_queue=o.max_queue,
                              prefix_cache=o.prefix_cache,
                              aliases=tuple(o.aliases) + (ref.path.name, ref.path.stem), spec=spec),
                tokenizer, serving.pipeline, publish=self.node.publish, draft=draft)
            self.server.follow_route(serving.stages())
            self._set(ModelStatus.READY, f"{serving.pipeline.n_stages} stage(s)")
            self.node.coordinator.on_lost = self._on_lost
            self.node.coordinator.on_joined = self._on_joined
            log.info("model %s ready on %d stage(s): %s/chat/completions", ref.name,
                     serving.pipeline.n_stages, self.node.http_url)
        except asyncio.CancelledError:
            raise
        except MeshnodeError as exc:
            self._set(ModelStatus.FAILED, str(exc))
            log.error("cannot serve %s: %s", o.model or "the default model", exc)
        except Exception as exc:  # noqa: BLE001 - a start-up bug must not kill the node
            self._set(ModelStatus.FAILED, f"{type(exc).__name__}: {exc}")
            log.exception("cannot serve %s", o.model or "the default model")

    async def _plan_and_load(self, ref, options):
        """Plan and load; while the mesh lacks the nodes a plan needs, wait for peers."""
        from meshnode.mesh.planner import PlanError

        deadline = time.monotonic() + self.options.wait_peers
        while True:
            try:
                return await self.node.coordinator.start_model(ref, options)
            except PlanError as exc:
                if time.monotonic() >= deadline:
                    raise
                self._set(ModelStatus.WAITING_FOR_PEERS, str(exc))
                await asyncio.sleep(1.0)

    # ---- failover ---------------------------------------------------------------------

    def _on_lost(self, serving, reason: str, node_id: str | None) -> None:
        """The coordinator's hook: ``serving`` (READY) lost a stage. Synchronous, before
        the waiting steps fail, so their requests find the route down."""
        if serving is not self.serving or self.server is None or self._replanning():
            return
        if self._upgrade is not None and not self._upgrade.done():
            self._upgrade.cancel()
        self._start_replan("lost", reason, frozenset({node_id}) if node_id else frozenset())

    def _on_joined(self, node_id: str) -> None:
        """The coordinator's hook: a peer authenticated. A degraded model looks for a
        better plan."""
        if (self._degraded and self.server is not None and not self._replanning()
                and (self._upgrade is None or self._upgrade.done())):
            self._upgrade = asyncio.get_running_loop().create_task(self._look_for_upgrade(), name="model-upgrade")

    def _replanning(self) -> bool:
        return self._replan is not None and not self._replan.done()

    def _start_replan(self, cause: str, reason: str, exclude: frozenset[str] = frozenset()) -> None:
        self.server.route.lost(reason)
        self._set(ModelStatus.RECOVERING, reason)
        log.warning("model %s: re-planning (%s)", self.model_ref.name, reason)
        self._replan = asyncio.get_running_loop().create_task(
            self._do_replan(cause, reason, exclude, time.monotonic(), time.time()), name="model-replan")

    async def _do_replan(self, cause: str, reason: str, exclude: frozenset[str], t0: float, wall: float) -> None:
        from meshnode.mesh.planner import PlanError
        from meshnode.mesh.replan import fallback_options
        from meshnode.mesh.runtime import NegotiationError

        old, self.serving = self.serving, None
        before = old.plan.n_stages if old is not None else 0
        waiting = self.server.in_flight
        serving, why = None, reason
        try:
            if old is not None:
                await old.stop(f"re-planning: {reason}", timeout=REPLAN_STOP_TIMEOUT_S)
            for i, options in enumerate(fallback_options(self._base)):
                try:
                    # First the same layer ranges (cached slices): the lost plan with its lost
                    # stages moved, or for a rejoin the plan the model started on.
                    keep = None if i else (old.plan if old is not None and cause == "lost" else self._first_plan)
                    serving = await self.node.coordinator.start_model(self.model_ref, options,
                                                                      exclude=exclude, keep=keep)
                except (PlanError, NegotiationError) as exc:
                    why = str(exc)
                    log.info("re-plan with %s: %s", _describe(options), exc)
                    continue
                self._degraded = options is not self._base
                break
        except asyncio.CancelledError:
            self.server.route.failed("the node is stopping")   # nobody waits for a route that never comes
            raise
        except Exception as exc:  # noqa: BLE001 - a re-plan bug must not leave requests hanging
            log.exception("re-planning %s failed", self.model_ref.name)
            serving, why = None, f"{type(exc).__name__}: {exc}"
        ms = 1e3 * (time.monotonic() - t0)
        if serving is None:
            self._degraded = True   # a member that joins may give it a route again
            self.server.route.failed(why)
            self._set(ModelStatus.FAILED, f"no route: {why}")
            log.error("model %s has no route after %.0f ms: %s", self.model_ref.name, ms, why)
        else:
            self.serving = serving
            self.server.switch_pipeline(serving.pipeline)
            self.server.follow_route(serving.stages())
            self._set(ModelStatus.READY, f"{serving.pipeline.n_stages} stage(s)")
            log.warning("model %s serves again on %d stage(s) after %.0f ms (%s)", self.model_ref.name,
                        serving.pipeline.n_stages, ms, "degraded" if self._degraded else "as planned")
        info = FailoverInfo(wall, cause, reason, before, serving.plan.n_stages if serving else 0, ms, waiting)
        self._failovers.appendleft(info)
        self.node.publish(ModelReplanned(info))

    async def _look_for_upgrade(self) -> None:
        """A member joined a degraded model: once the original options plan a different
        route and no request is in flight, re-plan to it."""
        from meshnode.mesh.planner import PlanError
        from meshnode.mesh.replan import upgrade_wanted

        for _ in range(UPGRADE_TRIES):
            await asyncio.sleep(UPGRADE_POLL_S)
            if self._replanning() or self.server is None:
                return
            try:
                desired, _ = await self.node.coordinator.plan_for(self.model_ref, self._base,
                                                                  keep=self._first_plan)
            except PlanError:
                continue
            current = self.serving.plan if self.serving is not None else None
            if not upgrade_wanted(current, desired):
                self._degraded = False
                return
            await self.server.wait_idle()   # never disturb a request in flight
            if self._replanning() or self.server is None:
                return
            self._start_replan("rejoined", "re-planning to use the members that joined")
            return

    def failovers(self) -> tuple[FailoverInfo, ...]:
        return tuple(self._failovers)

    def _set(self, state: ModelStatus, detail: str) -> None:
        self.state, self.detail = state, detail
        share = getattr(self.node, "mesh_share", None)
        if share is not None:   # members learn when the model becomes ready or goes
            share.models_changed()

    def _spec_config(self, ref):
        from meshnode.spec.strategy import SpecConfigError, resolve_strategy

        from meshnode.spec.strategy import PackageSpeculative

        pkg = None
        pkg_file = Path(ref.path).parent / "model-package.json"
        try:
            if pkg_file.is_file():
                pkg = PackageSpeculative.from_dict(json.loads(pkg_file.read_text()), origin=str(pkg_file))
        except (OSError, ValueError, RecursionError, SpecConfigError) as exc:   # (json recurses per level)
            log.warning("ignoring %s: %s", pkg_file, exc)
        try:
            return resolve_strategy(ref.name, cli=self.options.spec_cli, config=self.options.config,
                                    package=pkg)
        except SpecConfigError as exc:
            log.warning("speculative decoding off: %s", exc)
            return None

    async def _load_draft(self, spec, ref):
        if spec.type != "draft-model" or not spec.draft_model:
            return None
        try:
            from meshnode.engine.worker import run_compute
            from meshnode.models.store import resolve_model
            from meshnode.spec.draft import DraftModelProposer, check_vocab

            base = Path(ref.path).parent
            cand = Path(spec.draft_model)
            draft_spec = str(base / cand) if not cand.is_absolute() and (base / cand).exists() else spec.draft_model
            dref = await asyncio.to_thread(resolve_model, draft_spec, self.node.paths)
            await asyncio.to_thread(check_vocab, ref.path, dref.path)
            return await run_compute(functools.partial(
                DraftModelProposer, dref.path, n_threads=self.options.threads,
                gpu_layers=self.options.gpu_layers))
        except Exception as exc:  # noqa: BLE001 - never a failed start for a draft
            log.warning("draft model %r disabled: %s; serving without it", spec.draft_model, exc)
            return None

    # ---- snapshot parts ---------------------------------------------------------------

    def model_infos(self) -> tuple[ModelInfo, ...]:
        ref = self.model_ref
        if ref is None:
            return ()
        size = model_size(Path(ref.path))   # (every part of a split model; 0: gone)
        return (ModelInfo(ref.name, str(ref.path), ref.sha256, ref.n_layers, size, ref.architecture),)

    def transfers(self) -> tuple[TransferInfo, ...]:
        return tuple(self._transfers.values())

    async def stop(self, stage_timeout: float | None = None) -> None:
        """Stop serving: Stop to every stage, waiting up to ``stage_timeout`` s for their
        answers (default: the plan's own ``stop_timeout``)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self.node.coordinator.on_lost = self.node.coordinator.on_joined = None
        for task in (self._upgrade, self._replan):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self.server is not None:
            await self.server.close()
        if self.serving is not None:
            await self.serving.stop(timeout=stage_timeout)
        self._set("stopped", "")


def _describe(options) -> str:
    if options.explicit is not None:
        return f"--stages {options.explicit}"
    return f"--split {options.split}" if options.split is not None else "the planner's choice"
