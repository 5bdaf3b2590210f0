"""MeshFabric over real QUIC and real mDNS on loopback, in one process."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from meshnode.mesh.fabric import MeshFabric, PeerReplyError, PeerUnavailableError
from meshnode.net import aioquic_compat as compat
from meshnode.net.caps import from_dict
from meshnode.net.secret import new_secret
from meshnode.paths import NodePaths
from meshnode.wire import Error, ErrorCode, Forward, Segment, StageStatus, Status
from nodeproc import lo_multicast, until

pytestmark = pytest.mark.net


def _fabric(tmp_path, name: str, secret: bytes, **kw) -> MeshFabric:
    return MeshFabric(NodePaths.resolve(tmp_path / name).ensure(), secret=secret,
                      interfaces=["127.0.0.1"], name=name, **kw)


def _forward(i: int, width: int = 8) -> Forward:
    seg = Segment(session=1, pos=i, n_rows=1, n_logits=0, drafts=(), temperature=0.0,
                  top_k=0, top_p=1.0, seed=0, flags=0)
    return Forward(ref=0, batch_id=i, step=i, segments=(seg,), act=np.full((1, width), i, np.float32))


async def test_two_fabrics_discover_request_and_stream(tmp_path):
    if not lo_multicast():
        pytest.skip("multicast is off on lo")
    s = new_secret()
    a, b = _fabric(tmp_path, "a", s), _fabric(tmp_path, "b", s)
    changes: list = []
    a.on_peer_change(lambda nid, info, why: changes.append((nid, info is not None, why)))
    got: list = []

    async def on_b(node_id, msg):
        got.append(msg)
        if isinstance(msg, Status) and msg.state == StageStatus.CLAIMED:
            await b.send(node_id, Status(ref=msg.ref, term=msg.term, state=StageStatus.STOPPED, detail="", progress=1.0))
        elif isinstance(msg, Status) and msg.state == StageStatus.FAILED:
            await b.send(node_id, Error(ref=msg.ref, code=ErrorCode.BUSY, message="busy"))

    b.on_message(on_b)
    await a.start()
    await b.start()
    try:
        await until(lambda: len(a.peers()) == 1 and len(b.peers()) == 1, 2.0)
        assert a.peers()[0].name == "b" and a.peers()[0].authenticated
        assert changes and changes[0][1] is True
        reply = await a.request(b.node_id, Status(ref=0, term=7, state=StageStatus.CLAIMED, detail="", progress=0.0), timeout=2)
        assert reply.state == StageStatus.STOPPED and reply.term == 7
        with pytest.raises(PeerReplyError):
            await a.request(b.node_id, Status(ref=0, term=1, state=StageStatus.FAILED, detail="", progress=0.0), timeout=2)
        # data stream: ordered per key, delivered to on_message
        for i in range(50):
            await a.send_data(b.node_id, _forward(i), stream_key=("session", 1))
        await until(lambda: sum(isinstance(m, Forward) for m in got) == 50, 3.0)
        fw = [m for m in got if isinstance(m, Forward)]
        assert [m.step for m in fw] == list(range(50))
        assert float(fw[-1].act[0, 0]) == 49.0
        # capability updates reach the peer through the mDNS record
        caps = {**a.capabilities, "models": [{"name": "m", "sha256": "ab" * 32, "layers": 30, "size": 1}]}
        await a.set_capabilities(caps)
        await until(lambda: (c := b.peers()[0].capabilities) is not None and len(c.models) == 1, 2.0)
        assert from_dict(caps).models[0].n_layers == 30
        await until(lambda: a.peers()[0].rtt_ms is not None, 2.0)
    finally:
        await b.stop()
    await until(lambda: a.peers() == [], 2.0)
    assert changes[-1][1] is False
    with pytest.raises(PeerUnavailableError):
        await a.send(b.node_id, Status(ref=0, term=1, state=StageStatus.CLAIMED, detail="", progress=0.0))
    await a.stop()


async def test_duplicate_dials_keep_one_link(tmp_path):
    # Both ends dial each other (static peers, no mDNS): exactly one link survives.
    s = new_secret()
    a = _fabric(tmp_path, "a", s, discovery=False)
    await a.start()
    b = _fabric(tmp_path, "b", s, discovery=False, static_peers=[f"127.0.0.1:{a.port}"])
    await b.start()
    a._static = []  # noqa: SLF001 - (test setup) a learns b's port only now
    a2_task = asyncio.ensure_future(a._dial_once("127.0.0.1", b.port))  # noqa: SLF001
    try:
        await until(lambda: len(a.peers()) == 1 and len(b.peers()) == 1, 3.0)
        await asyncio.sleep(0.5)
        assert len(a.peers()) == 1 and len(b.peers()) == 1
        # Both ends send unpaced (net/aioquic_compat.py: aioquic held the 2nd datagram of an
        # activation behind a millisecond timer): a pacer that never names a later send time.
        for fabric in (a, b):
            [link] = fabric._links.values()  # noqa: SLF001
            pacer = compat.pacer(link.quic)
            pacer.update_rate(congestion_window=13500, smoothed_rtt=0.01)
            for _ in range(4):  # a burst drains a real pacer's bucket (it then names a time)
                pacer.update_after_send(now=1.0)
            assert pacer.next_send_time(now=1.0) is None
        reply_seen = []
        b.on_message(lambda nid, m: reply_seen.append(m))
        await a.send(b.node_id, Status(ref=0, term=1, state=StageStatus.CLAIMED, detail="", progress=0.0))
        await until(lambda: reply_seen, 2.0)
    finally:
        await a.stop()
        await b.stop()
        a2_task.cancel()


async def test_decode_exchange_sends_one_datagram_each_way(tmp_path):
    """A decode-step exchange on loopback: the activation (576 x f32, like SmolLM2) is
    one datagram (loopback datagrams are 16 KB), and the ACK of each message rides on
    the reply instead of a datagram of its own (meshnode/net/acks.py)."""
    s = new_secret()
    a = _fabric(tmp_path, "a", s, discovery=False)
    await a.start()
    b = _fabric(tmp_path, "b", s, discovery=False, static_peers=[f"127.0.0.1:{a.port}"])
    got_a: asyncio.Queue = asyncio.Queue()

    async def on_b(node_id, msg):
        if isinstance(msg, Forward):
            await b.send_data(node_id, Status(ref=0, term=msg.step, state=StageStatus.CLAIMED, detail="", progress=0.0),
                              stream_key="data")

    b.on_message(on_b)
    a.on_message(lambda nid, m: got_a.put_nowait(m))
    await b.start()
    try:
        await until(lambda: len(a.peers()) == 1 and len(b.peers()) == 1, 3.0)
        # the fast lane's probes are padded to its largest frame: counted, they would look
        # like activations, so count once both lanes are up (no probe after that)
        await until(lambda: a.lane_ready(b.node_id) and b.lane_ready(a.node_id), 5.0)
        sizes: dict[str, list[int]] = {"a": [], "b": []}
        for name, fabric in (("a", a), ("b", b)):
            [link] = fabric._links.values()  # noqa: SLF001
            transport = compat.datagram_transport(link)
            orig = transport.sendto

            def counting(data, addr=None, _orig=orig, _log=sizes[name]):
                _log.append(len(data))
                return _orig(data, addr)

            transport.sendto = counting
        n = 40
        for i in range(n):
            await a.send_data(b.node_id, _forward(i, width=576), stream_key="data")
            reply = await asyncio.wait_for(got_a.get(), 2.0)
            assert reply.term == i
            time.sleep(0.003)   # the next step's compute, inline on the loop as a stage runs it
        big = [x for x in sizes["a"] if x > 2304]
        assert len(big) == n, sizes["a"]                         # one datagram per activation
        # heartbeats (every 0.3 s) and their echoes may add a few; ACK datagrams would add ~n
        assert len(sizes["a"]) <= n + 6 and len(sizes["b"]) <= n + 6, sizes
    finally:
        await a.stop()
        await b.stop()


async def test_a_dial_cancelled_during_the_handshake_leaves_no_unretrieved_error(tmp_path):
    """A dial given up while QUIC still waits for the handshake (the peer's mDNS record
    went away, the node stops) left aioquic's shielded "connected" future to fail later
    with a ConnectionError nobody read: an ERROR line without a traceback in the log."""
    import gc
    import socket

    a = _fabric(tmp_path, "a", new_secret())
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)   # takes datagrams, never answers
    silent.bind(("127.0.0.1", 0))
    errors: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    try:
        dial = asyncio.ensure_future(a._dial_once("127.0.0.1", silent.getsockname()[1]))
        await asyncio.sleep(0.3)
        dial.cancel()
        await asyncio.gather(dial, return_exceptions=True)
        await asyncio.sleep(0.1)
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
        silent.close()
    assert [ctx.get("message") for ctx in errors] == []


async def test_a_forged_unreachable_hint_never_drops_a_live_peer(tmp_path):
    """An ICMP "port unreachable" is unauthenticated (meshnode.net.icmp): what a forged
    one does to a link, hints on both ends of a live link (the seam the kernel's error
    reaches), must not drop it: the peer answers the heartbeat sent at once."""
    s = new_secret()
    b = _fabric(tmp_path, "b", s, discovery=False)
    await b.start()
    a = _fabric(tmp_path, "a", s, discovery=False, static_peers=[f"127.0.0.1:{b.port}"])
    await a.start()
    lost: list = []
    a.on_peer_change(lambda nid, info, why: info is None and lost.append(why))
    try:
        await until(lambda: len(a.peers()) == 1 and len(b.peers()) == 1, 5.0)
        link_a, link_b = a._links[b.node_id], b._links[a.node_id]
        hb = link_a.liveness.seq
        for _ in range(5):
            link_a.unreachable()
            link_b.unreachable()
            await asyncio.sleep(0.3)
        assert link_a.liveness.seq > hb and link_a.liveness.hinted_at is None   # answered: hint cleared
        assert lost == [] and len(a.peers()) == 1 and len(b.peers()) == 1
    finally:
        await a.stop()
        await b.stop()



async def test_a_dial_to_a_closed_port_fails_fast_and_says_why(tmp_path):
    """Nobody listens at the address (a member that restarted on another port): the host
    answers with ICMP port unreachable, and the dial ends after LinkSettings.unreachable_s
    instead of the 3 s authentication deadline, with a reason a user can read."""
    import socket
    import sys

    if sys.platform != "linux":
        pytest.skip("ICMP errors are read on Linux only")
    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    a = _fabric(tmp_path, "a", new_secret(), discovery=False)
    # (the authentication deadline would have ended it with "authentication timed out")
    assert await a._dial_once("127.0.0.1", port) == "connect failed: port unreachable"
