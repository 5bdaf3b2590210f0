"""The mesh-wide endpoint: any node's ``/v1`` serves every model ready anywhere in the mesh.

Theory of operation. :class:`MeshShare` (one per node) plays three roles over the
authenticated links of the fabric; the coordinator's HTTP port is never involved.

* **Advertising.** A node whose model is ready sends ``ModelsServed`` (its whole list) to
  every member, again whenever the list changes (ready, stopped, shutting down) and to
  each member that joins; members keep the lists in a
  :class:`~meshnode.mesh.served_models.ServedModels` directory and drop a peer's entries
  when its link goes. ``/v1/models`` lists this node's model and the directory's
  (:class:`MeshClient`), each with its coordinator and context length.
* **Forwarding.** :class:`MeshForwardMiddleware` sits inside the HTTP guard, so a request
  has passed this node's Host, Origin, key, content-type, admission and body checks. A
  POST to a route that takes ``model`` (or a GET of ``/tokenizer_info``, whose query
  string travels as the body) whose model this node does not serve but a member
  does is carried to that member: ``ApiRequest`` (the body as it came) on a data stream of
  its own; the member's ``ApiResponseStart`` and ``ApiResponseBody`` frames are written to
  the client as they come (:meth:`MeshShare.forward`), so SSE chunks, ``usage``,
  ``timings``, error statuses and bodies, and ``[DONE]`` are the coordinator's own bytes.
  A client that goes away sends ``ApiCancel``. A coordinator lost before the status line
  gives a 503; lost mid-stream, an OpenAI error chunk and ``[DONE]``.
* **Serving for members.** An ``ApiRequest`` runs through this node's own ASGI app, with
  the loopback Host, JSON content type and (when the node has one) its API key, so every
  check of :mod:`meshnode.serve.http_guard` and of the routes applies unchanged (body cap,
  admission, validation, limits). ``ApiCancel`` or the member's link going delivers
  ``http.disconnect`` to the app, the path a local client's disconnect takes: the request
  is cancelled and its KV freed on every stage. Such a request is never forwarded again.

llama.cpp server's routes and the tokenizer's (``API_MODEL_OPTIONAL``) take a body without
``model``: on a node that serves no model itself, such a request goes to the coordinator
of the first model the mesh lists (the one ``/v1/models`` lists first), whose routes
answer it for their own model.

Bounds, against a member that misbehaves: the wire lets only the routes that take a
model be named (``API_PATHS``), bodies up to ``MAX_API_BODY``, response chunks up to
``MAX_API_CHUNK``, 16 headers, 16 models a coordinator; at most
``MAX_FORWARDED_PER_PEER`` requests of one member run at once (more get a 429); response
headers are filtered to ``RESPONSE_HEADERS`` both ways; a relay holds at most
``RELAY_BUFFER`` bytes its client has not taken yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message as AsgiMessage, Receive, Scope, Send

from meshnode.mesh.fabric import PeerUnavailableError
from meshnode.mesh.served_models import ServedModels
from meshnode.serve.client import EngineClient, GenerationRequest, ModelCard
from meshnode.serve.errors import (
    EngineUnavailableError, InvalidRequestError, ServerBusyError, UnknownModelError, error_body,
)
from meshnode.serve.sse import DONE, sse_data
from meshnode.serve.http_guard import replay_body
from meshnode.state import MeshModel, PeerInfo, printable
from meshnode.wire import (
    API_GET_PATHS,
    API_MODEL_OPTIONAL,
    API_PATHS,
    ApiCancel,
    ApiHeader,
    ApiRequest,
    ApiResponseBody,
    ApiResponseStart,
    Message,
    ModelsServed,
    ServedModel,
)
from meshnode.wire.messages import (
    MAX_API_BODY, MAX_API_CHUNK, MAX_API_QUERY, MAX_CAPABILITIES_LEN, MAX_MODEL_NAME_LEN, MAX_SERVED_MODELS,
)

log = logging.getLogger(__name__)

MAX_FORWARDED_PER_PEER = 8       # requests of one member served at once (more: 429)
RELAY_BUFFER = 4 << 20           # bytes a relay holds that its client has not taken
RESEND_S = 15.0                  # the served list goes out again this often (a replaced link)
CANCEL_GRACE_S = 2.0             # after http.disconnect, then the request's task is cancelled
INLINE_PARSE_BYTES = 64 * 1024   # bodies up to this size are read for `model` inline
RESPONSE_HEADERS = frozenset({"content-type", "retry-after", "www-authenticate", "cache-control",
                              "x-accel-buffering"})
FORWARDED_SCOPE_KEY = "meshnode.forwarded_from"


def stream_key(request_id: int) -> Hashable:
    """The data stream of one forwarded request (both directions use the same key)."""
    return ("api", request_id)


@dataclass
class _Relay:
    """A request this node forwarded: the coordinator's frames, queued for the client."""

    node_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    buffered: int = 0
    dead: bool = False      # lost or over budget: later frames are dropped

    def put(self, item: Any, size: int = 0) -> None:
        if self.dead:
            return
        if isinstance(item, _Lost):
            self.dead = True
        elif self.buffered + size > RELAY_BUFFER:
            self.dead = True
            item = _Lost("the coordinator sent more than this node holds for a client that is not reading",
                         cancel=True)
        self.buffered += size
        self.queue.put_nowait(item)


@dataclass(frozen=True)
class _Lost:
    reason: str
    cancel: bool = False    # the coordinator still runs it: cancel it there


@dataclass
class _Served:
    """A request a member forwarded to this node."""

    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


class MeshShare:
    """See the module docstring. ``node`` is the :class:`~meshnode.node.Node` (its
    ``service``, ``app``, ``http_security``, ``stopping`` and ``name``)."""

    def __init__(self, fabric: Any, node: Any) -> None:
        self.fabric = fabric
        self.node = node
        self.directory = ServedModels()
        self._advertised: tuple[ServedModel, ...] = ()
        self._relays: dict[int, _Relay] = {}
        self._served: dict[tuple[str, int], _Served] = {}
        self._resend: asyncio.Task | None = None
        # counters shown in /status (what members asked of this node, what it forwarded)
        self.counters = {"forwarded": 0, "served_for_members": 0, "cancelled_by_members": 0,
                         "refused_busy": 0}
        fabric.on_peer_change(self._peer_change)

    def start(self) -> None:
        self._resend = asyncio.get_running_loop().create_task(self._resend_loop(), name="mesh-share")

    def busy(self) -> bool:
        """Requests carried to members or served for them are in flight."""
        return bool(self._relays or self._served)

    def stop(self) -> None:
        if self._resend is not None:
            self._resend.cancel()
        for served in self._served.values():
            served.cancelled.set()

    # ---- advertising ------------------------------------------------------------------

    def local_models(self) -> tuple[ServedModel, ...]:
        """What this node serves now (nothing once it began to stop)."""
        node = self.node
        service = getattr(node, "service", None)
        server = getattr(service, "server", None)
        if node.stopping or server is None:
            return ()
        return tuple(ServedModel(c.id[:MAX_MODEL_NAME_LEN], c.n_ctx or 0, max(0, int(c.created)),
                                 ",".join(getattr(c, "capabilities", ()))[:MAX_CAPABILITIES_LEN])
                     for c in server.models() if c.id)[:MAX_SERVED_MODELS]

    def models_changed(self) -> None:
        """Tell every member when this node's list changed (called on the model service's
        state changes and at shutdown)."""
        models = self.local_models()
        if models == self._advertised:
            return
        self._advertised = models
        log.info("serving %s to the mesh", ", ".join(m.name for m in models) or "no model")
        for peer in self.fabric.peers():
            self._send_models(peer.node_id)

    def _send_models(self, node_id: str) -> None:
        with contextlib.suppress(PeerUnavailableError):
            self.fabric.send_data_now(node_id, ModelsServed(0, self._advertised), ("models",))

    async def _resend_loop(self) -> None:
        while True:
            await asyncio.sleep(RESEND_S)
            self.models_changed()
            if self._advertised:
                for peer in self.fabric.peers():
                    self._send_models(peer.node_id)

    def _peer_change(self, node_id: str, info: PeerInfo | None, reason: str) -> None:
        if info is not None:
            if self._advertised:
                self._send_models(node_id)
            return
        if self.directory.drop(node_id):
            log.info("models of %s gone from the mesh: %s", node_id, reason)
        for relay in self._relays.values():
            if relay.node_id == node_id:
                relay.put(_Lost(f"the node coordinating this model left the mesh ({printable(reason, 100)})"))
        for (peer, _), served in self._served.items():
            if peer == node_id:
                served.cancelled.set()

    # ---- fabric messages ----------------------------------------------------------------

    def handle(self, node_id: str, msg: Message) -> bool:
        """Take the messages of the mesh-wide endpoint; False for any other."""
        match msg:
            case ModelsServed(models=models):
                if self.directory.update(node_id, models):
                    log.info("member %s serves %s", node_id,
                             ", ".join(printable(m.name, 100) for m in models) or "no model")
            case ApiRequest():
                self._serve_for(node_id, msg)
            case ApiCancel(request_id=rid):
                served = self._served.get((node_id, rid))
                if served is not None:
                    self.counters["cancelled_by_members"] += 1
                    served.cancelled.set()
            case ApiResponseStart(request_id=rid) | ApiResponseBody(request_id=rid):
                relay = self._relays.get(rid)
                if relay is not None and relay.node_id == node_id:   # only its coordinator answers it
                    relay.put(msg, len(msg.data) if isinstance(msg, ApiResponseBody) else 0)
            case _:
                return False
        return True

    # ---- listing -----------------------------------------------------------------------

    def mesh_models(self) -> tuple[MeshModel, ...]:
        """Every model ready in the mesh: this node's, then each id once more, from the
        member requests for it go to (names are printable: they reach terminals)."""
        me = self.fabric
        out = [MeshModel(m.name, me.node_id, self.node.name, m.n_ctx, local=True) for m in self.local_models()]
        names = {p.node_id: p.name for p in self.fabric.peers()}
        seen = {m.name.lower() for m in out}
        for node_id, m in self.directory.entries():
            if m.name.lower() in seen:
                continue
            seen.add(m.name.lower())
            out.append(MeshModel(printable(m.name, MAX_MODEL_NAME_LEN), node_id,
                                 printable(names.get(node_id, ""), 64), m.n_ctx))
        return tuple(out)

    def route(self, model: str) -> str | None:
        """The member a request for ``model`` goes to; None: this node answers it itself
        (it serves the model, or nobody does)."""
        if self._serves_locally(model):
            return None
        hit = self.directory.route(model)
        return hit[0] if hit is not None else None

    def _serves_locally(self, model: str) -> bool:
        service = getattr(self.node, "service", None)
        server = getattr(service, "server", None)
        if server is None:
            return False
        settings = getattr(server, "settings", None)
        names = {c.id for c in server.models()} | set(getattr(settings, "aliases", ()))
        return model.lower() in {n.lower() for n in names}

    # ---- forwarding (this node's client, a member's model) -----------------------------

    async def forward(self, node_id: str, path: str, body: bytes, receive: Receive, send: Send) -> None:
        """Carry one request to ``node_id`` and its answer back to the client (see the
        module docstring)."""
        from meshnode.serve.openai_routes import error_response

        if len(body) > MAX_API_BODY:
            from meshnode.serve.errors import PayloadTooLargeError

            await _respond(error_response(PayloadTooLargeError(
                f"The request body is larger than a request carried to another node may be "
                f"({MAX_API_BODY} bytes).")), receive, send)
            return
        rid = secrets.randbits(63) or 1
        while rid in self._relays:
            rid = secrets.randbits(63) or 1
        relay = self._relays[rid] = _Relay(node_id)
        key = stream_key(rid)
        self.counters["forwarded"] += 1
        finished = started = sse = False
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            try:
                self.fabric.send_data_now(node_id, ApiRequest(0, rid, path, body), key)
            except PeerUnavailableError:
                await _respond(error_response(EngineUnavailableError(
                    "The node coordinating this model is not reachable right now; retry shortly.")), receive, send)
                finished = True
                return
            log.debug("request %x for %s carried to %s", rid, path, node_id)
            while True:
                get = asyncio.ensure_future(relay.queue.get())
                await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    log.debug("request %x: client went away", rid)
                    return
                item = get.result()
                if isinstance(item, ApiResponseStart) and not started:
                    headers = _headers_in(item.headers)
                    sse = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
                    started = True
                    await send({"type": "http.response.start", "status": item.status, "headers": headers})
                elif isinstance(item, ApiResponseBody) and started:
                    relay.buffered -= len(item.data)
                    await send({"type": "http.response.body", "body": item.data, "more_body": item.more})
                    if not item.more:
                        finished = True
                        return
                else:
                    reason = item.reason if isinstance(item, _Lost) else "the coordinator answered out of order"
                    log.info("request %x to %s ended: %s", rid, node_id, reason)
                    # a coordinator that is gone has nothing left to cancel
                    finished = isinstance(item, _Lost) and not item.cancel
                    await self._end_lost(reason, started, sse, receive, send)
                    return
        except OSError:   # the client's connection broke while we wrote to it
            log.debug("request %x: client connection broke", rid)
        finally:
            watch.cancel()
            self._relays.pop(rid, None)
            if not finished:
                with contextlib.suppress(PeerUnavailableError):
                    self.fabric.send_data_now(node_id, ApiCancel(0, rid), key)
            self.fabric.close_data_stream(node_id, key)

    @staticmethod
    async def _end_lost(reason: str, started: bool, sse: bool, receive: Receive, send: Send) -> None:
        from meshnode.serve.openai_routes import error_response

        err = EngineUnavailableError(f"The request was not finished: {reason}. Retry shortly.")
        if not started:
            await _respond(error_response(err), receive, send)
        elif sse:
            await send({"type": "http.response.body", "body": sse_data(error_body(err)) + DONE, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    # ---- serving for members (a member's client, this node's model) --------------------

    def _serve_for(self, node_id: str, msg: ApiRequest) -> None:
        key = (node_id, msg.request_id)
        if key in self._served:
            log.warning("member %s reused request id %x while it runs: ignored", node_id, msg.request_id)
            return
        if sum(1 for peer, _ in self._served if peer == node_id) >= MAX_FORWARDED_PER_PEER:
            self.counters["refused_busy"] += 1
            self._refuse_busy(node_id, msg.request_id)
            return
        served = self._served[key] = _Served()
        self.counters["served_for_members"] += 1
        served.task = asyncio.get_running_loop().create_task(self._serve(node_id, msg, served),
                                                             name=f"mesh-request-{msg.request_id:x}")

    def _refuse_busy(self, node_id: str, rid: int) -> None:
        err = ServerBusyError(f"This node already serves {MAX_FORWARDED_PER_PEER} requests of your node; "
                              "retry shortly.")
        body = json.dumps(error_body(err)).encode()
        with contextlib.suppress(PeerUnavailableError):
            self.fabric.send_data_now(node_id, ApiResponseStart(0, rid, 429, (
                ApiHeader("content-type", "application/json"), ApiHeader("retry-after", "1"))), stream_key(rid))
            self.fabric.send_data_now(node_id, ApiResponseBody(0, rid, body, False), stream_key(rid))
            self.fabric.close_data_stream(node_id, stream_key(rid))

    async def _serve(self, node_id: str, msg: ApiRequest, served: _Served) -> None:
        rid, key = msg.request_id, stream_key(msg.request_id)
        ended = started = body_given = False

        def out(frame: Message) -> None:
            try:
                self.fabric.send_data_now(node_id, frame, key)
            except PeerUnavailableError:
                served.cancelled.set()     # the member is gone: its client too

        async def receive() -> AsgiMessage:
            nonlocal body_given
            if not body_given:
                body_given = True
                body = b"" if msg.path in API_GET_PATHS else msg.body   # (a GET's is its query)
                return {"type": "http.request", "body": body, "more_body": False}
            await served.cancelled.wait()
            return {"type": "http.disconnect"}

        async def send(message: AsgiMessage) -> None:
            nonlocal started, ended
            if ended or served.cancelled.is_set():
                return
            if message["type"] == "http.response.start":
                started = True
                out(ApiResponseStart(0, rid, int(message["status"]), _headers_out(message.get("headers", ()))))
            elif message["type"] == "http.response.body" and started:
                data, more = bytes(message.get("body", b"")), bool(message.get("more_body", False))
                for i in range(0, len(data), MAX_API_CHUNK):
                    piece = data[i:i + MAX_API_CHUNK]
                    last = i + MAX_API_CHUNK >= len(data)
                    out(ApiResponseBody(0, rid, piece, more or not last))
                if not data and not more:
                    out(ApiResponseBody(0, rid, b"", False))
                ended = not more

        app = asyncio.ensure_future(self.node.app(self._scope(node_id, msg), receive, send))
        cancelled = asyncio.ensure_future(served.cancelled.wait())
        try:
            await asyncio.wait({app, cancelled}, return_when=asyncio.FIRST_COMPLETED)
            if not app.done():
                # the app saw http.disconnect: give it a moment to end the request its way
                await asyncio.wait({app}, timeout=CANCEL_GRACE_S)
                if not app.done():
                    app.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await app
        except Exception:
            log.exception("serving request %x of member %s failed", rid, node_id)
        finally:
            cancelled.cancel()
            if not app.done():
                app.cancel()
            self._served.pop((node_id, rid), None)
            if not ended and not served.cancelled.is_set():
                if not started:
                    await self._answer_failed(node_id, rid)
                else:
                    out(ApiResponseBody(0, rid, b"", False))
            self.fabric.close_data_stream(node_id, key)

    async def _answer_failed(self, node_id: str, rid: int) -> None:
        from meshnode.serve.errors import EngineFailedError

        body = json.dumps(error_body(EngineFailedError("Internal server error."))).encode()
        with contextlib.suppress(PeerUnavailableError):
            self.fabric.send_data_now(node_id, ApiResponseStart(0, rid, 500, (
                ApiHeader("content-type", "application/json"),)), stream_key(rid))
            self.fabric.send_data_now(node_id, ApiResponseBody(0, rid, body, False), stream_key(rid))

    def _scope(self, node_id: str, msg: ApiRequest) -> Scope:
        """The ASGI scope of a member's request: what a loopback client of this node
        would send (so the guard and the routes treat it as theirs), marked as forwarded."""
        get = msg.path in API_GET_PATHS
        headers = [(b"host", b"127.0.0.1")]
        if not get:
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(msg.body)).encode())]
        key = getattr(getattr(self.node, "http_security", None), "api_key", None)
        if key:
            headers.append((b"authorization", f"Bearer {key}".encode()))
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "GET" if get else "POST", "scheme": "http", "path": msg.path, "raw_path": msg.path.encode(),
            "query_string": msg.body if get else b"", "root_path": "", "headers": headers,
            "client": (f"mesh:{node_id[:16]}", 0), "server": ("127.0.0.1", 0),
            FORWARDED_SCOPE_KEY: node_id,
        }


# ---- the /v1 routes' view of the mesh -----------------------------------------------------


class MeshClient:
    """The node's :class:`~meshnode.serve.client.EngineClient` for the routes: generation
    by the local client; ``models()`` lists the mesh's too (requests for those never reach
    here: :class:`MeshForwardMiddleware` carries them to their coordinator)."""

    def __init__(self, local: EngineClient, share: MeshShare) -> None:
        self.local = local
        self.share = share

    def models(self) -> list[ModelCard]:
        local = {c.id.lower(): c for c in self.local.models()}
        out = []
        for m in self.share.mesh_models():
            card = local.get(m.name.lower())
            where = dict(coordinator_id=m.coordinator_id, coordinator_name=m.coordinator_name, local=m.local)
            if card is not None:
                out.append(replace(card, **where))
                continue
            hit = self.share.directory.route(m.name)
            created = hit[1].created if hit is not None else 0
            caps = tuple(c for c in hit[1].capabilities.split(",") if c) if hit is not None else ()
            out.append(ModelCard(id=m.name, created=created, n_ctx=m.n_ctx or None, capabilities=caps, **where))
        return out

    def generate(self, request: GenerationRequest):  # -> AsyncIterator[GenerationEvent]
        return self.local.generate(request)


class MeshForwardMiddleware:
    """ASGI middleware (inside the guard): a POST to a route of ``API_PATHS`` (a GET to one
    of ``API_GET_PATHS``, its model in the query) for a model a
    member serves goes to :meth:`MeshShare.forward` (with ``model`` left out where a route
    allows it, on a node without a model: the mesh's first model); everything else to the
    app. A node without a model of its own answers a model nobody serves with a 404."""

    def __init__(self, app: ASGIApp, node: Any) -> None:
        self.app = app
        self.node = node

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        share: MeshShare | None = getattr(self.node, "mesh_share", None)
        get = scope.get("path") in API_GET_PATHS
        if (share is None or scope["type"] != "http" or scope["method"] != ("GET" if get else "POST")
                or scope["path"] not in API_PATHS or FORWARDED_SCOPE_KEY in scope
                or getattr(self.node, "stopping", False)):   # stopping: the routes answer 503
            await self.app(scope, receive, send)
            return
        if get:   # a GET route's "body" on the wire is its query string
            body, replay = scope.get("query_string", b""), receive
            if len(body) > MAX_API_QUERY:
                from meshnode.serve.openai_routes import error_response

                await _respond(error_response(InvalidRequestError(
                    None, f"A query string of {len(body)} bytes; at most {MAX_API_QUERY}.")), receive, send)
                return
            model = _model_in_query(body) if share.directory else None
        else:
            body = await _read_body(receive)
            replay = replay_body(body, receive)
            model = await _model_of(body) if share.directory else None
        if (model is None and scope["path"] in API_MODEL_OPTIONAL and share.directory
                and not share.local_models() and (listed := share.mesh_models())):
            model = listed[0].name
        target = share.route(model) if model is not None else None
        if target is not None:
            await share.forward(target, scope["path"], body, receive, send)
            return
        if model is not None and getattr(self.node, "service", None) is None \
                and not getattr(self.node, "stopping", False):
            from meshnode.serve.openai_routes import error_response

            served = [m.name for m in share.mesh_models()]
            await _respond(error_response(UnknownModelError(model, served)), receive, send)
            return
        await self.app(scope, replay, send)


async def _read_body(receive: Receive) -> bytes:
    """The body the guard already read (and capped): one message, or a few."""
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(parts)


async def _model_of(body: bytes) -> str | None:
    """The request's ``model`` when the body is a JSON object naming one (anything else
    goes to the local routes, which answer it with their errors)."""
    def parse() -> str | None:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return None
        model = obj.get("model") if isinstance(obj, dict) else None
        return model if isinstance(model, str) else None

    if len(body) <= INLINE_PARSE_BYTES:
        return parse()
    return await asyncio.to_thread(parse)


def _model_in_query(query: bytes) -> str | None:
    """A GET route's ``?model=`` (the last one given, as the route reads it)."""
    values = parse_qs(query.decode("latin-1")).get("model")
    return values[-1] if values else None


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _respond(response: Any, receive: Receive, send: Send) -> None:
    await response({"type": "http", "method": "POST", "headers": []}, receive, send)


def _headers_out(raw: Any) -> tuple[ApiHeader, ...]:
    out = []
    for k, v in raw:
        name = (k.decode("latin-1") if isinstance(k, bytes) else str(k)).lower()
        value = v.decode("latin-1") if isinstance(v, bytes) else str(v)
        if name in RESPONSE_HEADERS and len(out) < 16:
            out.append(ApiHeader(name, value[:256]))
    return tuple(out)


def _headers_in(headers: tuple[ApiHeader, ...]) -> list[tuple[bytes, bytes]]:
    return [(h.name.lower().encode("latin-1"), h.value.encode("latin-1", "replace"))
            for h in headers if h.name.lower() in RESPONSE_HEADERS]


__all__ = ["MeshClient", "MeshForwardMiddleware", "MeshShare", "stream_key"]
