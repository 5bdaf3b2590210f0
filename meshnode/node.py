"""The running node: mesh fabric + HTTP server in one event loop.

Theory of operation: :class:`Node` owns a :class:`~meshnode.mesh.fabric.MeshFabric`
and a uvicorn server running :func:`meshnode.serve.app.create_app` as a task of the same
loop. When both are up it writes ``paths.runtime_file`` (pid, ports) so that
``meshnode status`` can find it, and removes it on :meth:`stop`. Front ends see it only
through :class:`meshnode.state.NodeAPI`: :meth:`snapshot` and :meth:`events`.

Serving: every node runs a :class:`~meshnode.mesh.runtime.StageServerRuntime` (it can
serve layer ranges of peers' models) and a :class:`~meshnode.mesh.runtime.CoordinatorRuntime`;
a node asked to coordinate a model also runs a :class:`~meshnode.serve.service.ModelService`,
whose EngineClient backs the ``/v1`` routes. Fabric messages are dispatched to whichever
of them claims them.

Shutdown (:meth:`Node.stop`, what SIGINT / SIGTERM and the TUI's quit run): new requests
get a 503 at once; requests in flight have ``shutdown_grace`` seconds to finish (and so
do the sessions peers' requests hold on the stage this node serves); what is left is
ended in-band (:meth:`~meshnode.serve.model_server.ModelServer.shutdown`: an error chunk
and ``[DONE]``, or an error JSON). Then the stages this node placed on peers get Stop
(they free their engines), the mDNS record is withdrawn, the links and the HTTP server
close. Each step after the grace has its own bound (a peer that does not answer Stop, a
client that does not read): typically they take half a second together.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import socket
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from meshnode import __version__, stallwatch
from meshnode.errors import MeshnodeError, cannot_listen
from meshnode.fsutil import atomic_write
from meshnode.mesh.local_caps import local_capabilities, set_offload
from meshnode.net import caps as capsmod
from meshnode.paths import NodePaths
from meshnode.quantizer import hand_in_quantizer
from meshnode.state import (
    LogEmitted,
    ModelStatus,
    NodeEvent,
    NodeInfo,
    NodeSnapshot,
    PeerDiscovered,
    PeerInfo,
    PeerLost,
    StageChanged,
    StageState,
    TelemetryPoint,
)
from meshnode.wire import Message

log = logging.getLogger(__name__)

EVENT_QUEUE = 1000
CAPS_REFRESH_S = 30.0
THREADS_CHECK_S = 2.0   # how often the served stage's thread count is looked at (a read)
TELEMETRY_POINTS = 240      # one a second: the last four minutes
HTTP_CONNECTIONS = 256
DEFAULT_SHUTDOWN_GRACE = 3.0    # seconds requests in flight get to finish at shutdown
# A stage session without a step this long belongs to no request in flight (its
# coordinator keeps it for prefix reuse): shutdown does not wait for it. Longer than any
# pause between the steps of a live request short of a stage taking 2 s per token.
STAGE_IDLE_S = 2.0
# The steps after the grace, each bounded so that a stuck peer or client cannot hold the
# process: peers' answers to Stop (they answer in milliseconds on a LAN), and responses
# still being written (after that uvicorn cancels them).
STAGE_STOP_S = 1.0
HTTP_CLOSE_S = 0.5


def freeze_startup_heap() -> None:
    """Take what the process holds once a node is up (modules, classes, the app, the
    node itself) out of the cyclic garbage collector's sight, for the process's life.

    Why: a full collection stops every thread, the event loop included, for as long as
    it walks every tracked object; right after start-up that is ~110k objects and ~55 ms
    on a 2-core VM (a ~100 ms loop stall on a GPU host, `MESHNODE_STALL_MS` shows them),
    and nearly none of them ever becomes garbage. Frozen, they are skipped, and a full
    collection walks only what serving allocated since. Called by the programs that run
    a node (``meshnode serve``, the TUI), not by :class:`Node`: tests and embedders run
    many nodes in one process and must not freeze each other's garbage."""
    gc.collect()
    gc.freeze()
    log.debug("start-up heap frozen: %d objects out of the garbage collector's walks", gc.get_freeze_count())


class Node:
    """One meshnode process (implements :class:`meshnode.state.NodeAPI`)."""

    def __init__(
        self,
        paths: NodePaths,
        *,
        port: int = 0,
        http_port: int = 8642,
        http_host: str = "127.0.0.1",
        interfaces: list[str] | None = None,
        name: str | None = None,
        static_peers: list[str] | tuple[str, ...] = (),
        discovery: bool = True,
        service: Any = None,
        threads: int | None = None,
        decode_threads: int | None = None,
        gpu_layers: int = 0,
        max_memory: int | None = None,
        http_security: Any = None,
        shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
        share: bool = True,
        keep_responses: str = "disk",
    ) -> None:
        from meshnode.engine.shelf import EngineShelf
        from meshnode.mesh.coordinator import CoordinatorRuntime
        from meshnode.mesh.fabric import MeshFabric
        from meshnode.mesh.share import ShareService
        from meshnode.mesh.stage_server import StageServerRuntime
        from meshnode.serve.http_guard import HttpSecurity, check_binding
        from meshnode.serve.mesh_share import MeshShare
        from meshnode.serve.service import ModelService

        # Refused before anything starts: an endpoint reachable from the network needs a key.
        self.http_security = http_security or HttpSecurity()
        check_binding(http_host, self.http_security.api_key)
        if self.http_security.bound_host != http_host:
            self.http_security = replace(self.http_security, bound_host=http_host)
        self.paths = paths.ensure()
        # the Responses API's kept answers (serve/response_store.py), on disk unless told
        from meshnode.serve.response_disk import ResponseDisk
        from meshnode.serve.response_store import ResponseStore

        self.responses = ResponseStore(journal=ResponseDisk.open(self.paths.data) if keep_responses == "disk" else None)
        hand_in_quantizer()   # the store makes the default model with it on first use
        set_offload(gpu_layers != 0)
        self.name = name or socket.gethostname()
        self.fabric = MeshFabric(
            # the chosen name only: mDNS announces no hostname the user did not choose
            self.paths, port=port, interfaces=interfaces, name=name, static_peers=static_peers,
            discovery=discovery,
        )
        self._http_host = http_host
        self._interfaces = interfaces
        self._http_port = http_port
        self._server: Any = None
        self._server_task: asyncio.Task | None = None
        self._caps_task: asyncio.Task | None = None
        # one capability refresh at a time: each reads the node's state when its turn comes,
        # so a refresh begun before a change cannot land after the one that carries it
        self._caps_lock = asyncio.Lock()
        self._caps_retry_s = 1.0
        self._telemetry_task: asyncio.Task | None = None
        self._telemetry: deque[TelemetryPoint] = deque(maxlen=TELEMETRY_POINTS)
        self._subscribers: set[asyncio.Queue] = set()
        self._log_handler: logging.Handler | None = None
        self._started_at: float | None = None
        self.shutdown_grace = shutdown_grace
        self._stop_task: asyncio.Task | None = None
        self.fabric.on_peer_change(self._on_peer_change)
        self.max_memory = max_memory
        self.gpu_layers = gpu_layers
        # one shelf for every engine the node loads (engine/shelf.py): an engine freed by a
        # re-plan is taken back by the next plan's stage of the same range, this node's own
        # stage 0 or a stage it serves for a peer
        shelf = EngineShelf()
        self.stage_server = StageServerRuntime(self.fabric, self.paths, n_threads=threads,
                                               decode_threads=decode_threads, gpu_layers=gpu_layers,
                                               publish=self._served_stage_event,
                                               max_memory=max_memory, shelf=shelf)
        self.coordinator = CoordinatorRuntime(self.fabric, self.paths, n_threads=threads,
                                              decode_threads=decode_threads, gpu_layers=gpu_layers,
                                              publish=self.publish, shelf=shelf)
        # model sharing (docs/models.md): answers members' pulls; Prepare fetches through it
        self.share = ShareService(self.fabric, self.paths, enabled=share)
        self.stage_server.share = self.share
        self.share.on_rate = self.advertise_models   # peers plan with the measured rate
        self.service = ModelService(self, service) if service is not None else None
        # the mesh-wide endpoint: models served anywhere, requests carried to them
        self.mesh_share = MeshShare(self.fabric, self)
        self.app: Any = None     # the HTTP app (members' requests run through it too)
        self.fabric.on_message(self._dispatch)

    # ---- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Start the fabric and the HTTP server, then write the runtime file.

        Raises :class:`MeshnodeError` when the HTTP port cannot be bound."""
        import uvicorn

        from meshnode.serve.app import create_app

        import anyio

        self._install_log_handler()
        stallwatch.start(asyncio.get_running_loop())   # debug telemetry, off by default
        # starlette loads anyio's asyncio backend inside the first request otherwise, with
        # the event loop held for the import (~10 ms here, ~100 ms measured on a GPU host)
        await anyio.sleep(0)
        from meshnode.models.store import sweep_stale_temps

        await asyncio.to_thread(sweep_stale_temps, self.paths)   # before the store is listed
        # Capabilities (held models, memory budget) go out in the Hello of every link, so
        # they must be known before the first link: peers reached by --peer see no mDNS.
        await self._advertise()
        await self.fabric.start()
        journal = self.responses.journal
        if journal is not None:
            kept = self.responses.restore(await asyncio.to_thread(
                journal.load, self.responses.max_entries, self.responses.max_bytes))
            if kept:
                log.info("kept responses: %d taken back from %s", kept, self.paths.data)
        self.app = create_app(self)
        await self.share.start(self.fabric.port)
        config = uvicorn.Config(
            self.app, host=self._http_host, port=self._http_port,
            log_level="warning", lifespan="off", access_log=False,
            # connections and requests at once; past it uvicorn answers 503 without
            # reading (the guard's max_requests bounds generation requests well below)
            limit_concurrency=HTTP_CONNECTIONS, server_header=False,
            # responses still being written this long after shutdown are cancelled
            timeout_graceful_shutdown=HTTP_CLOSE_S,
        )
        self._server = _EmbeddedServer(config)
        try:
            await _check_bindable(self._http_host, self._http_port)
        except MeshnodeError:
            await self.fabric.stop()
            raise
        self._server_task = asyncio.get_running_loop().create_task(self._serve_http())
        while not self._server.started:
            if self._server_task.done():
                await self.fabric.stop()
                exc = self._server_task.exception() if not self._server_task.cancelled() else None
                raise MeshnodeError(
                    f"cannot serve HTTP on {self._http_host}:{self._http_port}"
                    + (f": {exc}" if exc else " (port in use?)")
                )
            await asyncio.sleep(0.01)
        self._http_port = self._server.servers[0].sockets[0].getsockname()[1]
        self._started_at = time.time()
        with atomic_write(self.paths.runtime_file) as f:
            f.write(json.dumps({
                "pid": os.getpid(), "http_port": self._http_port, "http_host": self._http_host,
                "quic_port": self.fabric.port, "node_id": self.fabric.node_id,
                "started": self._started_at,
            }).encode())
        self._caps_task = asyncio.get_running_loop().create_task(self._refresh_caps())
        self._telemetry_task = asyncio.get_running_loop().create_task(self._sample_telemetry())
        log.info("node %s up: HTTP %s, QUIC port %d", self.name, self.http_url, self.fabric.port)
        self.mesh_share.start()
        if self.service is not None:
            self.service.start()

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` began: new requests are refused."""
        return self._stop_task is not None

    async def stop(self, grace: float | None = None) -> None:
        """Shut down (see the module docstring); idempotent: a second call waits for the
        first. ``grace``: seconds requests in flight get (default ``shutdown_grace``)."""
        if self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(
                self._shutdown(self.shutdown_grace if grace is None else grace), name="node-stop")
        await asyncio.shield(self._stop_task)

    async def _shutdown(self, grace: float) -> None:
        t0 = time.monotonic()
        with contextlib.suppress(FileNotFoundError):
            self.paths.runtime_file.unlink()
        if self._caps_task is not None:
            self._caps_task.cancel()
        if self._telemetry_task is not None:
            self._telemetry_task.cancel()
        self.mesh_share.models_changed()    # members stop sending requests here
        server = self.service.server if self.service is not None else None
        if server is not None:
            with contextlib.suppress(Exception):
                ended = await server.shutdown(grace)
                if ended:
                    log.info("ended %d request(s) still running after the %.1f s grace", ended, grace)
        await self._wait_stage_sessions(t0 + grace)
        if self.service is not None:
            with contextlib.suppress(Exception):
                await self.service.stop(stage_timeout=STAGE_STOP_S)
        self.mesh_share.stop()
        with contextlib.suppress(Exception):
            await self.coordinator.close()
        with contextlib.suppress(Exception):
            await self.stage_server.stop()
        with contextlib.suppress(Exception):
            await self.share.close()
        await self.fabric.stop()
        if self._server is not None:
            _quiet_cancelled_responses()
            self._server.should_exit = True
            if self._server_task is not None:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(self._server_task, HTTP_CLOSE_S + 0.5)
            self._server = None
        if self.responses.journal is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.responses.journal.close)
        log.info("node %s stopped in %.1f s", self.name, time.monotonic() - t0)
        if self._log_handler is not None:
            logging.getLogger("meshnode").removeHandler(self._log_handler)
            self._log_handler = None

    async def _wait_stage_sessions(self, deadline: float) -> None:
        """Give the requests of peers' models that pass through the stage this node
        serves, and those carried to or from members, until ``deadline`` to end (their
        coordinators end the sessions). A session without a step for ``STAGE_IDLE_S`` is
        one its coordinator keeps for prefix reuse, not a request in flight."""
        while ((self.stage_server.busy_sessions(STAGE_IDLE_S) or self.mesh_share.busy())
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)

    # ---- NodeAPI ---------------------------------------------------------------

    @property
    def http_url(self) -> str:
        host = "127.0.0.1" if self._http_host in ("0.0.0.0", "") else self._http_host
        return f"http://{host}:{self._http_port}/v1"

    @property
    def http_port(self) -> int:
        return self._http_port

    def snapshot(self) -> NodeSnapshot:
        f = self.fabric
        caps = capsmod.from_dict(f.capabilities) or local_capabilities()
        info = NodeInfo(
            node_id=f.node_id, name=self.name, mesh_id=f.mesh_id,
            address=f"{self._address()}:{f.port}", http_url=self.http_url,
            capabilities=caps, version=__version__,
        )
        svc = self.service
        server = svc.server if svc is not None else None
        ref = svc.model_ref if svc is not None else None
        stages = self.snapshot_stages()
        return NodeSnapshot(
            node=info, peers=tuple(f.peers()),
            model=ref.name if ref is not None else None,
            model_layers=ref.n_layers if ref is not None else 0,
            stages=stages + tuple(self.stage_server.stages()),
            requests=server.requests() if server is not None else (),
            spec=server.spec_stats() if server is not None else (),
            telemetry=tuple(self._telemetry),
            models=svc.model_infos() if svc is not None else (),
            transfers=(svc.transfers() if svc is not None else ()) + self.share.progress(),
            status=svc.state if svc is not None else ModelStatus.NO_MODEL,
            status_detail=svc.detail if svc is not None else "",
            mesh_models=self.mesh_share.mesh_models(),
            failovers=svc.failovers() if svc is not None else (),
        )

    @property
    def engine_client(self) -> Any:
        """What the /v1 routes talk to (a 503-answering stand-in until a model is ready);
        its model list holds the mesh's models too (serve/mesh_share.py)."""
        from meshnode.serve.mesh_share import MeshClient
        from meshnode.serve.service import UnavailableClient

        if self.stopping:
            from meshnode.serve.model_server import SHUTTING_DOWN

            return UnavailableClient(lambda: SHUTTING_DOWN)
        if self.service is None:
            local: Any = UnavailableClient(lambda: "this node coordinates no model (started with --no-model)")
        else:
            local = self.service.engine_client
        return MeshClient(local, self.mesh_share)

    async def _serve_http(self) -> None:
        try:
            await self._server.serve()
        except SystemExit:
            # uvicorn exits the process when it cannot start (after logging why): a node
            # turns that into its own error, and start() stops what it had started
            raise MeshnodeError("the HTTP server could not start (see the line above)") from None

    def advertise_models(self) -> None:
        """Refresh the capabilities peers see (free memory under --max-memory, held models)."""
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(self._advertise())

    async def _advertise(self) -> None:
        from meshnode.mesh.runtime import node_capabilities, warm_headers

        async with self._caps_lock:
            try:
                caps = await asyncio.to_thread(node_capabilities, self.paths, max_memory=self.max_memory,
                                               share=self.share.enabled,
                                               fetch_bytes_per_s=self.share.fetch_bytes_per_s,
                                               parked_bytes=self.stage_server.shelf.held_bytes(),
                                               parked_vram=self.stage_server.shelf.held_vram(),
                                               stage_threads=self.stage_server.served_threads())
                await self.fabric.set_capabilities(caps)
                await asyncio.to_thread(warm_headers, self.paths)   # for a coordinator's Prepare
                self._caps_retry_s = 1.0
            except Exception:  # noqa: BLE001 - stale capabilities are better than a dead node
                # (e.g. the store changing under the listing): again soon, not at the next
                # periodic refresh, backing off while it keeps failing
                log.debug("capability refresh failed; again in %.0f s", self._caps_retry_s, exc_info=True)
                asyncio.get_running_loop().call_later(self._caps_retry_s, self.advertise_models)
                self._caps_retry_s = min(CAPS_REFRESH_S, 2 * self._caps_retry_s)

    def _dispatch(self, node_id: str, msg: Message) -> None:
        """Route a fabric message to whichever part of the node owns it.

        Synchronous: the fabric calls it inside the datagram's callback, so an
        activation or a returned token reaches its stage without a task and a loop
        iteration in between (both handlers only queue or resolve a future)."""
        if self.coordinator.handle(node_id, msg):
            return
        if self.stage_server.handle(node_id, msg):
            return
        if self.share.handle(node_id, msg):
            return
        if self.mesh_share.handle(node_id, msg):   # after the per-token paths
            return
        log.debug("unhandled %s from %s", type(msg).__name__, node_id)

    async def events(self) -> AsyncIterator[NodeEvent]:
        q: asyncio.Queue = asyncio.Queue(EVENT_QUEUE)
        self._subscribers.add(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._subscribers.discard(q)

    def _served_stage_event(self, event: NodeEvent) -> None:
        """An event of the stage this node serves for a peer: to subscribers, and once the
        stage is ready its CPU threads to peers (capabilities; again when the engine
        adapts them: :meth:`_refresh_caps`), so its coordinator shows them."""
        self.publish(event)
        if isinstance(event, StageChanged) and event.stage.state is StageState.READY:
            self.advertise_models()

    def publish(self, event: NodeEvent) -> None:
        """Hand ``event`` to every subscriber (a full queue drops its oldest event)."""
        for q in self._subscribers:
            if q.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()
            q.put_nowait(event)

    # ---- internals ------------------------------------------------------------

    def _address(self) -> str:
        from meshnode.net.discovery import advertised_addresses

        if self._interfaces:
            return advertised_addresses(self._interfaces)[0]
        return _primary_address()

    def _on_peer_change(self, node_id: str, info: PeerInfo | None, reason: str) -> None:
        self.publish(PeerDiscovered(info) if info is not None else PeerLost(node_id, reason))

    async def _sample_telemetry(self) -> None:
        """One :class:`TelemetryPoint` a second: throughput, latency, hops and link traffic."""
        last_tokens, last_t = 0, time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            server = self.service.server if self.service is not None else None
            tokens = server.tokens_out if server is not None else 0
            tps = (tokens - last_tokens) / (now - last_t)
            last_tokens, last_t = tokens, now
            peers = self.fabric.peers()
            stage_nodes = {st.node_id for st in self.snapshot_stages()}
            rtts = [p.rtt_ms for p in peers if p.rtt_ms is not None and p.node_id in stage_nodes]
            self._telemetry.append(TelemetryPoint(
                t=time.time(), tokens_per_s=tps,
                ttft_ms=server.last_ttft_ms if server is not None else None,
                tpot_ms=server.last_tpot_ms if server is not None and tps else None,
                hop_ms=(sum(rtts) / len(rtts) / 2) if rtts else None,
                link_bytes_per_s=sum(p.bytes_per_s_in + p.bytes_per_s_out for p in peers)))

    def snapshot_stages(self) -> tuple:
        svc = self.service
        return tuple(svc.serving.stages()) if svc is not None and svc.serving is not None else ()

    async def _refresh_caps(self) -> None:
        """Capabilities again every CAPS_REFRESH_S, and soon after the served stage's
        thread count changes (its engine adapts it to the cores free), so that the
        coordinator's status shows the new count within seconds rather than half a minute."""
        told = self.stage_server.served_threads()
        waited = 0.0
        while True:
            await asyncio.sleep(THREADS_CHECK_S)
            waited += THREADS_CHECK_S
            now = self.stage_server.served_threads()
            if waited >= CAPS_REFRESH_S or now != told:
                told, waited = now, 0.0
                await self._advertise()

    def _install_log_handler(self) -> None:
        node = self

        class _Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if node._subscribers:
                    with contextlib.suppress(Exception):
                        node.publish(LogEmitted(record.levelno, record.name, record.getMessage(), record.created))

        self._log_handler = _Handler(logging.NOTSET)  # the logger's level decides
        logging.getLogger("meshnode").addHandler(self._log_handler)


class _CancelledResponse(logging.Filter):
    """uvicorn reports a response it cancelled at shutdown (a client that stopped reading
    its stream) as "Exception in ASGI application" with a CancelledError traceback; it is
    the shutdown working as intended, so one line without the traceback says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError):
            record.msg, record.args = "a response was cut off at shutdown (its client was not reading)", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def _quiet_cancelled_responses() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _CancelledResponse) for f in logger.filters):
        logger.addFilter(_CancelledResponse())


async def _check_bindable(host: str, port: int) -> None:
    """Raise :class:`MeshnodeError` saying why ``host:port`` cannot be listened on (taken by
    another program, an address not of this machine), before uvicorn tries: it logs the
    error in its own format and exits the process (``sys.exit``), which a node that has
    already joined its mesh must not do."""
    if port == 0:
        return   # any free port
    try:
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, host, port)
    except OSError as exc:
        raise cannot_listen(f"serve HTTP on {host}:{port}", exc, "--port") from None
    server.close()
    await server.wait_closed()


class _EmbeddedServer:
    """uvicorn's Server without its signal capture (the node's owner handles signals)."""

    def __new__(cls, config: Any) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # type: ignore[override]
                yield

        return Server(config)


def _primary_address() -> str:
    with contextlib.suppress(OSError):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    return "127.0.0.1"
