"""The fast lane (meshnode.net.lane): sealing, replay protection, and real UDP beside QUIC."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.mesh.fabric import MeshFabric
from meshnode.net.lane import HEADER_SIZE, LaneDrop, LaneReceiver, LaneSender, is_lane_packet, lane_key_id
from meshnode.net.link import LinkSettings
from meshnode.net.secret import new_secret
from meshnode.paths import NodePaths
from meshnode.wire import Forward, Segment, SegmentResult, StageStatus, Status, TokenReturn, encode
from nodeproc import until


def _pair() -> tuple[LaneSender, LaneReceiver]:
    rx = LaneReceiver()
    return LaneSender(rx.key_id, rx.key), rx


def test_a_sealed_frame_opens_to_the_same_bytes():
    tx, rx = _pair()
    frame = encode(Status(ref=3, term=1, state=StageStatus.CLAIMED, detail="", progress=0.5))
    packet = tx.seal(frame)
    assert is_lane_packet(packet) and lane_key_id(packet) == rx.key_id
    assert frame not in packet                      # sealed, not just framed
    assert rx.open(packet) == frame
    padded = tx.seal(frame, pad_to=4096)            # a probe: as big as the frames it vouches for
    assert len(padded) == 13 + 4096 + 16
    assert rx.open(padded) == frame + bytes(4096 - len(frame))


def test_replayed_late_forged_and_foreign_packets_are_dropped():
    tx, rx = _pair()
    p1, p2, p3 = (tx.seal(b"frame %d" % i) for i in range(3))
    assert rx.open(p2) == b"frame 1"
    with pytest.raises(LaneDrop, match="late or replayed"):
        rx.open(p2)                                 # the same packet again
    with pytest.raises(LaneDrop, match="late or replayed"):
        rx.open(p1)                                 # older than one already taken
    forged = bytearray(p3)
    forged[-1] ^= 1
    with pytest.raises(LaneDrop, match="authentication"):
        rx.open(bytes(forged))
    other_tx, _ = _pair()
    with pytest.raises(LaneDrop):
        rx.open(other_tx.seal(b"not for you"))      # another receiver's key
    with pytest.raises(LaneDrop, match="shorter"):
        rx.open(p3[:HEADER_SIZE + 3])
    assert rx.open(p3) == b"frame 2"                # a forgery did not burn the real packet
    assert rx.dropped == 5


def test_a_wrong_length_key_is_refused():
    with pytest.raises(ValueError):
        LaneSender(1, b"short")
    with pytest.raises(ValueError):
        LaneReceiver(1, b"x" * 15)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_dropped_or_opened_never_crash(data):
    _, rx = _pair()
    try:
        rx.open(data)
    except LaneDrop:
        pass
    else:  # pragma: no cover - would need a forged AES-GCM tag
        pytest.fail("random bytes opened")


def test_quic_packets_are_never_lane_packets():
    """Every QUIC v1 packet has the fixed bit (0x40) set; a lane packet's first byte is
    0x01. Checked on real packets from aioquic's client handshake."""
    from aioquic.quic.configuration import QuicConfiguration
    from aioquic.quic.connection import QuicConnection

    conn = QuicConnection(configuration=QuicConfiguration(is_client=True, verify_mode=ssl.CERT_NONE))
    conn.connect(("127.0.0.1", 4433), now=0.0)
    packets = [d for d, _ in conn.datagrams_to_send(now=0.0)]
    assert packets and not any(is_lane_packet(p) for p in packets)
    assert all(p[0] & 0x40 for p in packets)


# ---- real sockets -----------------------------------------------------------------------

def _fabric(tmp_path, name: str, secret: bytes, static=(), **kw) -> MeshFabric:
    return MeshFabric(NodePaths.resolve(tmp_path / name).ensure(), secret=secret, interfaces=["127.0.0.1"],
                      name=name, discovery=False, static_peers=list(static), bind_host="127.0.0.1", **kw)


def _decode_step(batch_id: int, width: int = 576) -> Forward:
    seg = Segment(session=1, pos=batch_id, n_rows=1, n_logits=1, drafts=(), temperature=0.0,
                  top_k=0, top_p=1.0, seed=0, flags=1)
    return Forward(ref=0, batch_id=batch_id, step=0, segments=(seg,),
                   act=np.full((1, width), batch_id, np.float32))


@pytest.mark.net
async def test_frames_travel_the_lane_both_ways_and_forgeries_do_not_hurt(tmp_path):
    s = new_secret()
    a = _fabric(tmp_path, "a", s)
    await a.start()
    b = _fabric(tmp_path, "b", s, static=[f"127.0.0.1:{a.port}"])
    got_a: list = []
    got_b: list = []
    a.on_message(lambda nid, m: got_a.append(m))
    b.on_message(lambda nid, m: got_b.append(m))
    await b.start()
    try:
        await until(lambda: a.lane_ready(b.node_id) and b.lane_ready(a.node_id), 5.0)
        link_a = a._links[b.node_id]
        stream_bytes = link_a.rx.total
        # the server side (a) and the dialling side (b) both send and receive on the lane
        for i in range(1, 21):
            assert a.send_lane(b.node_id, _decode_step(i))
            assert b.send_lane(a.node_id, TokenReturn(ref=0, batch_id=i, results=(
                SegmentResult(session=1, tokens=(i,), n_accepted=0, n_drafted=0),)))
        await until(lambda: len(got_b) == 20 and len(got_a) == 20, 3.0)
        assert [m.batch_id for m in got_b] == list(range(1, 21))
        assert float(got_b[-1].act[0, 0]) == 20.0
        assert [m.results[0].tokens for m in got_a] == [(i,) for i in range(1, 21)]
        assert link_a.rx.total > stream_bytes   # counted as link traffic for the UI
        # the decode rows of wide models take the lane too (an 8B's 4096 x f32, a 70B's
        # 8192): over QUIC streams they cost a GPU split a millisecond a token
        for i, width in ((22, 4096), (23, 8192)):
            assert a.send_lane(b.node_id, _decode_step(i, width))
        await until(lambda: len(got_b) == 22, 3.0)
        assert [m.act.shape for m in got_b[-2:]] == [(1, 4096), (1, 8192)]
        assert not a.send_lane(b.node_id, _decode_step(24, 16384))   # over one datagram: the caller uses QUIC
        del got_b[20:]

        # garbage, a forged lane packet and a replay, straight at a's QUIC port
        replay = link_a._lane_tx.seal(encode(_decode_step(99)))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
            for junk in (b"\x01" + os.urandom(60), b"\x01", os.urandom(1200), replay, replay):
                raw.sendto(junk, ("127.0.0.1", a.port))
        await asyncio.sleep(0.2)
        assert len(got_a) == 20   # nothing of that was taken (the replay's key is b's, not a's)
        assert a.send_lane(b.node_id, _decode_step(25))
        await until(lambda: len(got_b) == 21, 2.0)
        assert a.peers()[0].authenticated and a.lane_ready(b.node_id)
    finally:
        await b.stop()
        await a.stop()


@pytest.mark.net
async def test_the_quic_sockets_ask_for_buffers_that_hold_a_burst(tmp_path):
    """asyncio reads one datagram per loop iteration: while a step computes on the loop a
    burst waits in the socket, and the default ~208 KB receive buffer drops lane frames
    (each then costs its request a second). Both the listener's socket and a dialling
    link's own get SOCKET_BUFFER, or as much as the OS allows."""
    from meshnode.limits import SOCKET_BUFFER

    try:
        cap = int(open("/proc/sys/net/core/rmem_max").read())
    except OSError:
        pytest.skip("needs Linux's /proc/sys/net/core/rmem_max")
    s = new_secret()
    a = _fabric(tmp_path, "a", s)
    await a.start()
    b = _fabric(tmp_path, "b", s, static=[f"127.0.0.1:{a.port}"])
    await b.start()
    try:
        await until(lambda: b.node_id in a._links and a.node_id in b._links, 5.0)
        socks = [a._links[b.node_id]._transport.get_extra_info("socket"),
                 b._links[a.node_id]._transport.get_extra_info("socket")]
        assert socks[0].getsockname() != socks[1].getsockname()   # the listener's, b's own
        for sock in socks:   # (Linux reports twice what it grants)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= 2 * min(SOCKET_BUFFER, cap)
    finally:
        await b.stop()
        await a.stop()


@pytest.mark.net
async def test_a_node_with_the_lane_off_gets_everything_over_quic(tmp_path):
    s = new_secret()
    a = _fabric(tmp_path, "a", s, settings=LinkSettings(lane=False))
    await a.start()
    b = _fabric(tmp_path, "b", s, static=[f"127.0.0.1:{a.port}"])
    await b.start()
    try:
        await until(lambda: len(a.peers()) == 1 and len(b.peers()) == 1, 5.0)
        await asyncio.sleep(0.8)   # several probe periods
        assert not a.lane_ready(b.node_id) and not b.lane_ready(a.node_id)
        assert not b.send_lane(a.node_id, _decode_step(1))
    finally:
        await b.stop()
        await a.stop()


@pytest.mark.net
async def test_lost_lane_frames_switch_the_lane_off_for_a_while(tmp_path, caplog):
    s = new_secret()
    a = _fabric(tmp_path, "a", s, settings=LinkSettings(lane_backoff_s=0.6))
    await a.start()
    b = _fabric(tmp_path, "b", s, static=[f"127.0.0.1:{a.port}"])
    await b.start()
    try:
        await until(lambda: a.lane_ready(b.node_id), 5.0)
        a.lane_missed(b.node_id)
        assert a.lane_ready(b.node_id)                  # one lost frame: still on
        a.lane_missed(b.node_id)                        # a second one right after: off
        assert not a.lane_ready(b.node_id)
        assert "using QUIC streams, probing it again in 1 s" in caplog.text
        assert not a.send_lane(b.node_id, _decode_step(1))
        await asyncio.sleep(0.4)                        # heartbeats came, no probe yet
        assert not a.lane_ready(b.node_id)
        # after the backoff a probe brings it back (a path that healed)
        await until(lambda: a.lane_ready(b.node_id), 3.0)
    finally:
        await b.stop()
        await a.stop()
