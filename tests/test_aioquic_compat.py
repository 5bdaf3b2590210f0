"""meshnode.net.aioquic_compat: every private hook into aioquic still exists on the
installed aioquic, and each one still does what the link relies on (sans-IO, no socket).

When an aioquic upgrade fails here, the message names the hook and the installed
version: see the function of that name in meshnode/net/aioquic_compat.py for why it is
needed, then adapt it (and the aioquic range in pyproject.toml)."""

from __future__ import annotations

import asyncio
import ssl
from importlib.metadata import version
from typing import Any

import pytest

from aioquic import tls
from aioquic.asyncio import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import HandshakeCompleted

from meshnode.net import aioquic_compat as compat
from meshnode.net.identity import Identity
from meshnode.net.link import LinkSettings
from meshnode.net.quic import quic_configuration

AIOQUIC = version("aioquic")
ADDR = ("127.0.0.1", 4433)


def _client() -> QuicConnection:
    conn = QuicConnection(configuration=QuicConfiguration(is_client=True, verify_mode=ssl.CERT_NONE))
    conn.connect(ADDR, now=0.0)     # creates the TLS context and the packet spaces
    return conn


async def _owners() -> dict[str, Any]:
    """One live object per owner named in compat.HOOKS (instance attributes only exist there)."""
    conn = _client()
    server = QuicServer(configuration=QuicConfiguration(is_client=False))
    return {
        "QuicConnection": conn,
        "QuicPacketRecovery": getattr(conn, "_loss", None),
        "tls.Context": conn.tls,
        "QuicPacketSpace": getattr(conn, "_spaces", {}).get(tls.Epoch.ONE_RTT),
        "QuicConnectionProtocol": QuicConnectionProtocol(_client()),
        "QuicServer": server,
    }


async def test_every_hook_exists_on_the_installed_aioquic():
    owners = await _owners()
    assert {owner for owner, _ in compat.HOOKS} <= set(owners), "a hook's owner is not built above"
    missing = [f"{owner}.{attr}" for owner, attr in compat.HOOKS
               if owners[owner] is None or not hasattr(owners[owner], attr)]
    assert not missing, (
        f"aioquic {AIOQUIC} no longer has {', '.join(missing)}, which meshnode/net/aioquic_compat.py "
        f"relies on: adapt the hook(s) there (or pin aioquic below {AIOQUIC} in pyproject.toml)")


def test_the_requirement_names_a_tested_range():
    """pyproject.toml bounds aioquic on both sides (an upgrade past the tested range must
    come through this file), and the installed aioquic is inside that range."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    [req] = [Requirement(r) for r in pyproject["project"]["dependencies"] if r.startswith("aioquic")]
    ops = {spec.operator for spec in req.specifier}
    assert ops & {">=", ">", "~=", "=="} and ops & {"<", "<=", "~=", "=="}, (
        f"the aioquic requirement {req} must name a tested range (lower and upper bound)")
    assert req.specifier.contains(AIOQUIC), (
        f"aioquic {AIOQUIC} is installed, outside the tested range {req.specifier}")


async def test_unpace_swaps_in_a_pacer_that_never_holds_a_packet():
    conn = _client()
    assert compat.unpace(conn), f"aioquic {AIOQUIC}: the pacer is not at QuicConnection._loss._pacer"
    pacer = compat.pacer(conn)
    assert isinstance(pacer, compat.Unpaced)
    pacer.update_rate(congestion_window=13500, smoothed_rtt=0.01)
    for _ in range(4):
        pacer.update_after_send(now=1.0)
    assert pacer.next_send_time(now=1.0) is None


def test_datagram_size_reads_and_grows():
    conn = _client()
    assert compat.max_datagram_size(conn) == QuicConfiguration(is_client=True).max_datagram_size
    compat.set_max_datagram_size(conn, 16384)
    assert compat.max_datagram_size(conn) == 16384


def _pair(a: Identity, b: Identity) -> tuple[QuicConnection, QuicConnection, bytes]:
    """A meshnode client and server connection (not yet connected to each other) and the
    client's first datagram: aioquic's QuicServer creates the server-side connection
    from it the same way."""
    from aioquic.buffer import Buffer
    from aioquic.quic.packet import pull_quic_header

    settings = LinkSettings()
    client = QuicConnection(configuration=quic_configuration(a, is_client=True, settings=settings))
    client.connect(ADDR, now=0.0)
    first = next(iter(client.datagrams_to_send(now=0.0)))[0]
    header = pull_quic_header(Buffer(data=first), host_cid_length=8)
    server = QuicConnection(configuration=quic_configuration(b, is_client=False, settings=settings),
                            original_destination_connection_id=header.destination_cid)
    return client, server, first


def _events(conn: QuicConnection) -> list:
    out = []
    while (ev := conn.next_event()) is not None:
        out.append(ev)
    return out


def test_the_server_asks_for_and_both_sides_read_the_peer_certificate():
    a, b = Identity.generate(), Identity.generate()
    client, server, first = _pair(a, b)
    compat.request_client_certificate(server)
    server.receive_datagram(first, ("127.0.0.1", 1234), now=0.0)
    for _ in range(10):   # the handshake, in memory
        for data, _ in server.datagrams_to_send(now=0.0):
            client.receive_datagram(data, ADDR, now=0.0)
        for data, _ in client.datagrams_to_send(now=0.0):
            server.receive_datagram(data, ("127.0.0.1", 1234), now=0.0)
    for conn in (client, server):
        assert any(isinstance(e, HandshakeCompleted) for e in _events(conn)), (
            f"aioquic {AIOQUIC}: the in-memory handshake did not complete")
    assert compat.peer_certificate(server) == a.certificate, (
        f"aioquic {AIOQUIC}: the server did not get the client's certificate "
        "(request_client_certificate / peer_certificate)")
    assert compat.peer_certificate(client) == b.certificate
    space = compat.one_rtt_ack_space(client)
    assert space is not None, f"aioquic {AIOQUIC}: no 1-RTT packet space with ack_at"
    space.ack_at = 5.0
    compat.ack_with_next_packet(space, 1.0)
    assert space.ack_at == 1.0
    compat.ack_with_next_packet(space, 7.0)         # never later than aioquic planned
    assert space.ack_at == 1.0


def test_without_the_hook_the_server_gets_no_client_certificate():
    """The control for the test above: aioquic does not ask on its own."""
    a, b = Identity.generate(), Identity.generate()
    client, server, first = _pair(a, b)
    server.receive_datagram(first, ("127.0.0.1", 1234), now=0.0)
    for _ in range(10):
        for data, _ in server.datagrams_to_send(now=0.0):
            client.receive_datagram(data, ADDR, now=0.0)
        for data, _ in client.datagrams_to_send(now=0.0):
            server.receive_datagram(data, ("127.0.0.1", 1234), now=0.0)
    assert compat.peer_certificate(server) is None


class _Recorder(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.events: list = []

    def quic_event_received(self, event: Any) -> None:
        self.events.append(event)


class _Transport(asyncio.DatagramTransport):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list = []

    def sendto(self, data: Any, addr: Any = None) -> None:
        self.sent.append((data, addr))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


async def test_feed_datagram_dispatches_events_without_transmitting():
    _, server, first = _pair(Identity.generate(), Identity.generate())
    proto = _Recorder(server)
    transport = _Transport()
    proto.connection_made(transport)
    assert compat.datagram_transport(proto) is transport
    compat.feed_datagram(proto, first, ("127.0.0.1", 1234), now=0.0)
    assert transport.sent == []                     # the transmit is ours to schedule
    assert server.datagrams_to_send(now=0.0)        # ... and there is something to send
    assert proto.events                             # events went to quic_event_received
    compat.mark_closed(proto)
    await asyncio.wait_for(proto.wait_closed(), 1.0)


async def test_the_prefiltered_server_hands_taken_datagrams_to_the_filter_only():
    taken: list = []

    def prefilter(data: bytes, addr: Any) -> bool:
        if data[:1] == b"\x01":
            taken.append(data)
            return True
        return False

    server = compat.PrefilteredQuicServer(prefilter, configuration=QuicConfiguration(is_client=False))
    transport = _Transport()
    server.connection_made(transport)
    server.datagram_received(b"\x01lane", ("127.0.0.1", 1))
    server.datagram_received(b"\x40" + b"\0" * 30, ("127.0.0.1", 1))   # to aioquic: ignored junk
    assert taken == [b"\x01lane"]


@pytest.mark.parametrize("name", compat.__all__)
def test_every_exported_name_exists(name):
    assert hasattr(compat, name)
