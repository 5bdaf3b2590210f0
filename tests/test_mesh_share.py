"""The mesh-wide endpoint's framing and bounds (fast): wire messages, the directory, and
MeshShare's two ends joined by an in-memory fabric that passes every frame through the
real encoder and decoder. The end-to-end behaviour with real nodes is
tests/test_mesh_endpoint.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from meshnode.mesh.fabric import PeerUnavailableError
from meshnode.mesh.served_models import ServedModels
from meshnode.serve import mesh_share
from meshnode.serve.mesh_share import MeshForwardMiddleware, MeshShare
from meshnode.state import PeerInfo
from meshnode.wire import (
    ApiCancel,
    ApiHeader,
    ApiRequest,
    ApiResponseBody,
    ApiResponseStart,
    FrameDecoder,
    LocalProtocolError,
    ModelsServed,
    ServedModel,
    WireError,
    encode,
)
from meshnode.wire.messages import MAX_API_BODY, MAX_API_CHUNK, MAX_API_QUERY, MAX_SERVED_MODELS

# ---- wire ---------------------------------------------------------------------------------


def _roundtrip(msg):
    [got] = FrameDecoder().feed(encode(msg))
    return got


def test_messages_round_trip():
    for msg in (
        ModelsServed(0, (ServedModel("m", 2048, 1700000000), ServedModel("other", 0, 0))),
        ApiRequest(0, 7, "/v1/chat/completions", b'{"model": "m"}'),
        ApiResponseStart(0, 7, 200, (ApiHeader("content-type", "text/event-stream; charset=utf-8"),)),
        ApiResponseBody(0, 7, b"data: [DONE]\n\n", False),
        ApiCancel(0, 7),
    ):
        assert _roundtrip(msg) == msg


@pytest.mark.parametrize("msg", [
    ModelsServed(0, tuple(ServedModel(f"m{i}", 1, 0) for i in range(MAX_SERVED_MODELS + 1))),
    ModelsServed(0, (ServedModel("x" * 129, 1, 0),)),
    ModelsServed(0, (ServedModel("", 1, 0),)),
    ApiRequest(0, 1, "/status", b"{}"),                      # only the generation routes
    ApiRequest(0, 1, "/v1/models", b"{}"),
    ApiRequest(0, 0, "/v1/completions", b"{}"),              # request id 0
    ApiRequest(0, 1, "/v1/completions", bytes(MAX_API_BODY + 1)),
    ApiRequest(0, 1, "/tokenizer_info", b"model=" + b"x" * MAX_API_QUERY),   # a GET's query: 8 KiB
    ApiResponseBody(0, 1, bytes(MAX_API_CHUNK + 1), True),
    ApiResponseStart(0, 1, 99, ()),
    ApiResponseStart(0, 1, 200, tuple(ApiHeader("x-a", "b") for _ in range(17))),
    ApiResponseStart(0, 1, 200, (ApiHeader("set cookie", "x"),)),
    ApiResponseStart(0, 1, 200, (ApiHeader("x-a", "line\r\nbreak"),)),
], ids=lambda m: type(m).__name__)
def test_out_of_bounds_is_neither_sent_nor_accepted(msg):
    with pytest.raises(LocalProtocolError):
        encode(msg)


def test_a_frame_naming_another_route_is_refused_on_decode():
    good = encode(ApiRequest(0, 1, "/v1/completions", b"{}"))
    bad = good.replace(b"/v1/completions", b"/v1/completionz")
    [err] = FrameDecoder().feed(bad)
    assert isinstance(err, WireError) and "not one of" in err.detail


# ---- the directory -------------------------------------------------------------------------


def test_directory_replaces_drops_and_routes_to_the_lowest_node_id():
    d = ServedModels()
    assert not d and d.route("m") is None
    assert d.update("b", (ServedModel("M", 512, 0),))
    assert not d.update("b", (ServedModel("M", 512, 0),))      # the same list: no change
    d.update("a", (ServedModel("m", 1024, 0), ServedModel("n", 1, 0)))
    assert d.route("m")[0] == "a" and d.route("M")[1].n_ctx == 1024
    d.update("a", (ServedModel("n", 1, 0),))                   # a's list replaced
    assert d.route("m")[0] == "b"
    assert d.drop("b") and not d.drop("b")
    assert d.route("m") is None and [m.name for _, m in d.entries()] == ["n"]
    d.update("a", ())
    assert not d


# ---- both ends over an in-memory fabric ------------------------------------------------------


class MemFabric:
    """Two of these joined: each message is encoded, decoded and handed to the peer's
    MeshShare on the next loop iteration (ordered, like one QUIC stream)."""

    def __init__(self, node_id: str, name: str) -> None:
        self.node_id, self.name = node_id, name
        self.other: MemFabric | None = None
        self.share: MeshShare | None = None
        self.cbs = []
        self.sent: list = []
        self.closed: list = []
        self.up = True

    def on_peer_change(self, cb):
        self.cbs.append(cb)

    def peers(self):
        o = self.other
        return [PeerInfo(o.node_id, o.name, "mem", 0.1, True)] if o is not None and self.up else []

    def send_data_now(self, node_id, msg, key):
        if not self.up:
            raise PeerUnavailableError("down")
        self.sent.append(msg)
        [got] = FrameDecoder().feed(encode(msg))
        other = self.other
        asyncio.get_running_loop().call_soon(other.share.handle, self.node_id, got)

    def close_data_stream(self, node_id, key):
        self.closed.append(key)

    def cut(self):
        """The link goes: both ends hear it."""
        for f in (self, self.other):
            f.up = False
            for cb in f.cbs:
                cb((f.other or f).node_id, None, "link lost")


def _app_node(app, *, name="coord", api_key=None):
    server = SimpleNamespace(models=lambda: [SimpleNamespace(id="big-model", n_ctx=4096, created=5)],
                             settings=SimpleNamespace(aliases=("big.gguf",)))
    return SimpleNamespace(name=name, stopping=False, app=app, service=SimpleNamespace(server=server),
                           http_security=SimpleNamespace(api_key=api_key))


def _pair(coord_app, **kw):
    fc, ff = MemFabric("c" * 16, "coord"), MemFabric("f" * 16, "fwd")
    fc.other, ff.other = ff, fc
    coord = MeshShare(fc, _app_node(coord_app, **kw))
    fwd_node = SimpleNamespace(name="fwd", stopping=False, service=None, app=None,
                               http_security=SimpleNamespace(api_key=None))
    fwd = MeshShare(ff, fwd_node)
    fwd_node.mesh_share = fwd
    fc.share, ff.share = coord, fwd
    return coord, fwd, fc, ff, fwd_node


class Client:
    """The HTTP client side of the forwarder's ASGI call."""

    def __init__(self, body: dict) -> None:
        self.body = json.dumps(body).encode()
        self.messages: list[dict] = []
        self.gone = asyncio.Event()
        self._given = False

    async def receive(self):
        if not self._given:
            self._given = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        self.messages.append(message)

    @property
    def status(self):
        return next(m["status"] for m in self.messages if m["type"] == "http.response.start")

    @property
    def headers(self):
        return dict(next(m["headers"] for m in self.messages if m["type"] == "http.response.start"))

    @property
    def data(self):
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


def _scope(path="/v1/chat/completions"):
    return {"type": "http", "method": "POST", "path": path, "headers": []}


async def _advertise(coord: MeshShare, fwd: MeshShare):
    coord.models_changed()
    for _ in range(5):
        await asyncio.sleep(0)
    assert fwd.route("big-model") == coord.fabric.node_id


async def _local(scope, receive, send):   # what the forwarder's own routes would answer
    await send({"type": "http.response.start", "status": 299, "headers": []})
    await send({"type": "http.response.body", "body": b"local", "more_body": False})


def test_a_large_answer_comes_back_whole_in_bounded_chunks_with_filtered_headers():
    seen = {}
    big = bytes(range(256)) * 1000   # 256 KB: several chunks

    async def app(scope, receive, send):
        seen["scope"] = scope
        seen["body"] = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"set-cookie", b"a=b"), (b"x-secret", b"1")]})
        await send({"type": "http.response.body", "body": big, "more_body": False})

    async def main():
        coord, fwd, fc, ff, node = _pair(app, api_key="k3y")
        await _advertise(coord, fwd)
        client = Client({"model": "BIG-MODEL", "messages": []})
        await MeshForwardMiddleware(_local, node)(_scope(), client.receive, client.send)
        assert client.status == 200 and client.data == big
        assert client.headers == {b"content-type": b"application/json"}
        bodies = [m for m in fc.sent if isinstance(m, ApiResponseBody)]
        assert len(bodies) == -(-len(big) // MAX_API_CHUNK) and all(len(m.data) <= MAX_API_CHUNK for m in bodies)
        assert [m.more for m in bodies] == [True] * (len(bodies) - 1) + [False]
        # the member's request reached the app as a loopback client of the node would send it
        s = seen["scope"]
        assert s["path"] == "/v1/chat/completions" and s[mesh_share.FORWARDED_SCOPE_KEY] == ff.node_id
        assert (b"authorization", b"Bearer k3y") in s["headers"] and (b"host", b"127.0.0.1") in s["headers"]
        assert json.loads(seen["body"])["model"] == "BIG-MODEL"
        assert not coord._served and not fwd._relays       # nothing held afterwards

    asyncio.run(main())


def test_local_and_unknown_models_are_not_forwarded():
    async def app(scope, receive, send):
        raise AssertionError("not forwarded")

    async def main():
        coord, fwd, fc, ff, node = _pair(app)
        await _advertise(coord, fwd)
        client = Client({"model": "nobody-serves-this", "messages": []})
        await MeshForwardMiddleware(_local, node)(_scope(), client.receive, client.send)
        assert client.status == 404 and json.loads(client.data)["error"]["code"] == "model_not_found"
        assert "Served: big-model (GET /v1/models" in json.loads(client.data)["error"]["message"]
        client = Client({"model": "big-model"})
        await MeshForwardMiddleware(_local, node)(_scope("/v1/embeddings"), client.receive, client.send)
        assert client.status == 299       # not a route a member can reach: the local app answers
        node.service = object()           # a node with a model of its own: unknown names are its 404s
        client = Client({"model": "nobody-serves-this"})
        await MeshForwardMiddleware(_local, node)(_scope(), client.receive, client.send)
        assert client.status == 299
        # the coordinator's own (aliased) model is its own
        assert coord.route("big.gguf") is None and coord.route("big-model") is None

    asyncio.run(main())


def test_client_disconnect_cancels_and_the_app_sees_http_disconnect():
    events = []

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        events.append((await receive())["type"])     # waits for the member's ApiCancel

    async def main():
        coord, fwd, fc, ff, node = _pair(app)
        await _advertise(coord, fwd)
        client = Client({"model": "big-model"})
        task = asyncio.ensure_future(MeshForwardMiddleware(_local, node)(_scope(), client.receive, client.send))
        while not client.data:
            await asyncio.sleep(0.01)
        client.gone.set()
        await asyncio.wait_for(task, 2)
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert any(isinstance(m, ApiCancel) for m in ff.sent)
        assert events == ["http.disconnect"] and coord.counters["cancelled_by_members"] == 1
        assert not coord._served

    asyncio.run(main())


@pytest.mark.parametrize("when", ["before the status", "mid-stream"])
def test_coordinator_lost(when, monkeypatch):
    # the app below ignores http.disconnect: after the grace its task is cancelled
    monkeypatch.setattr(mesh_share, "CANCEL_GRACE_S", 0.05)
    async def app(scope, receive, send):
        await receive()
        if when == "mid-stream":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": b"data: {\"x\": 1}\n\n", "more_body": True})
        await asyncio.sleep(30)

    async def main():
        coord, fwd, fc, ff, node = _pair(app)
        await _advertise(coord, fwd)
        client = Client({"model": "big-model", "stream": True})
        task = asyncio.ensure_future(MeshForwardMiddleware(_local, node)(_scope(), client.receive, client.send))
        for _ in range(20):
            await asyncio.sleep(0.01)
        fc.cut()
        await asyncio.wait_for(task, 2)
        if when == "before the status":
            assert client.status == 503
            assert json.loads(client.data)["error"]["code"] == "engine_unavailable"
        else:
            assert client.status == 200
            chunks = [c for c in client.data.decode().split("\n\n") if c]
            assert chunks[-1] == "data: [DONE]" and "error" in json.loads(chunks[-2][6:])
        assert fwd.route("big-model") is None      # its entries went with the link
        await asyncio.sleep(0.2)
        assert not coord._served     # the coordinator stopped the member's request too

    asyncio.run(main())


def test_a_member_gets_at_most_its_share_of_requests_at_once(monkeypatch):
    monkeypatch.setattr(mesh_share, "MAX_FORWARDED_PER_PEER", 2)

    async def main():
        gate = asyncio.Event()

        async def app(scope, receive, send):
            await receive()
            await gate.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok", "more_body": False})

        coord, fwd, fc, ff, node = _pair(app)
        await _advertise(coord, fwd)
        clients = [Client({"model": "big-model"}) for _ in range(3)]
        tasks = [asyncio.ensure_future(MeshForwardMiddleware(_local, node)(_scope(), c.receive, c.send))
                 for c in clients]
        for _ in range(20):
            await asyncio.sleep(0.01)
        refused = [c for c in clients if c.messages]
        assert len(refused) == 1 and refused[0].status == 429
        assert refused[0].headers[b"retry-after"] == b"1"
        gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 2)
        assert sorted(c.status for c in clients) == [200, 200, 429]
        assert coord.counters["refused_busy"] == 1

    asyncio.run(main())


def test_a_relay_holds_at_most_its_buffer_for_a_client_that_does_not_read(monkeypatch):
    monkeypatch.setattr(mesh_share, "RELAY_BUFFER", 100_000)

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(10):
            await send({"type": "http.response.body", "body": bytes(30_000), "more_body": True})
        await receive()

    async def main():
        coord, fwd, fc, ff, node = _pair(app)
        await _advertise(coord, fwd)
        client = Client({"model": "big-model", "stream": True})
        stuck = asyncio.Event()

        async def slow_send(message):   # takes the status line, then stops reading
            client.messages.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                return
            if message["type"] == "http.response.body":
                await stuck.wait()

        task = asyncio.ensure_future(MeshForwardMiddleware(_local, node)(_scope(), client.receive, slow_send))
        for _ in range(30):
            await asyncio.sleep(0.01)
        [relay] = fwd._relays.values()
        assert relay.dead and relay.buffered <= 100_000 + 30_000
        stuck.set()
        await asyncio.wait_for(task, 2)
        assert b"[DONE]" in client.data    # ended with an error chunk, the request cancelled
        await asyncio.sleep(0.05)
        assert any(isinstance(m, ApiCancel) for m in ff.sent)

    asyncio.run(main())
