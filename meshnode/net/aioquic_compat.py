"""Every place meshnode reaches past aioquic's public API, in one module.

Theory of operation: aioquic's documented surface (``QuicConfiguration``,
``QuicConnection``'s methods, ``QuicConnectionProtocol.transmit`` / ``wait_closed`` /
``quic_event_received``, ``connect`` / ``serve``) does not cover what a LAN mesh
needs: the server must ask for the client's certificate and the link must read it,
pacing and the ACK timer cost a decode step milliseconds, loopback peers want bigger
datagrams, and the fast lane shares the QUIC socket. Each of those needs one private
attribute or method of aioquic; each is one small function (or the one server subclass)
here, with a docstring saying why, so that the rest of ``meshnode.net`` only calls
these. Where a hook is missing the caller falls back to aioquic's own behaviour when it
can (pacing, ACK timing, datagram size) and fails loudly where it cannot (the peer's
certificate is the mesh identity).

``HOOKS`` names every private attribute relied on; ``tests/test_aioquic_compat.py``
checks each one on the installed aioquic, so an upgrade that removes one fails there
with the hook's name and the aioquic version instead of somewhere deep in a link.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aioquic import tls
from aioquic.asyncio import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicPacketType, pull_quic_header
from aioquic.quic.recovery import QuicPacketPacer

__all__ = [
    "HOOKS", "Unpaced", "PrefilteredQuicServer", "ReadsConnectFailure", "ack_with_next_packet",
    "datagram_transport", "feed_datagram", "mark_closed", "max_datagram_size", "one_rtt_ack_space",
    "open_flow_control", "pacer", "peer_certificate", "received_stream_bytes",
    "request_client_certificate", "set_max_datagram_size", "unpace", "validated_peer_address",
]

# (owner, attribute): every private (or ":meta private:") name of aioquic used below; the
# compat test looks each one up on fresh aioquic objects.
HOOKS: tuple[tuple[str, str], ...] = (
    ("QuicConnection", "_loss"),                       # unpace, pacer
    ("QuicPacketRecovery", "_pacer"),                  # unpace, pacer
    ("QuicConnection", "_max_datagram_size"),          # max_datagram_size / set_max_datagram_size
    ("QuicConnection", "_initialize"),                 # request_client_certificate
    ("tls.Context", "_request_client_certificate"),    # request_client_certificate
    ("tls.Context", "_peer_certificate"),              # peer_certificate
    ("QuicConnection", "_spaces"),                     # one_rtt_ack_space
    ("QuicPacketSpace", "ack_at"),                     # ack_with_next_packet
    ("QuicConnectionProtocol", "_quic"),               # feed_datagram
    ("QuicConnectionProtocol", "_process_events"),     # feed_datagram
    ("QuicConnectionProtocol", "datagram_received"),   # PeerLink overrides it (":meta private:")
    ("QuicConnectionProtocol", "_transport"),          # datagram_transport
    ("QuicConnectionProtocol", "_closed"),             # mark_closed
    ("QuicServer", "datagram_received"),               # PrefilteredQuicServer
    ("QuicServer", "_protocols"),                      # PrefilteredQuicServer (admission)
    ("QuicConnection", "_local_max_data"),             # received_stream_bytes, open_flow_control
    ("QuicConnection", "_network_paths"),              # validated_peer_address, has_network_path
    ("QuicConnectionProtocol", "_connected_waiter"),   # ReadsConnectFailure
)


# ---- pacing ------------------------------------------------------------------------------

class Unpaced(QuicPacketPacer):
    """A pacer that never holds a packet back (the congestion window still bounds bursts).

    aioquic paces packets at cwnd / srtt. On a LAN that rate is microseconds per packet,
    but a held packet waits for an asyncio timer, and the event loop sleeps in whole
    milliseconds (epoll's resolution): the second datagram of a 2.3 KB activation (one
    SmolLM2 decode step in f32) left ~1.5 ms after the first. `meshnode bench net`, 576 x
    f32 round trip, two runs each: paced 1.74 / 1.51 ms, unpaced 0.82 / 0.83 ms. Our
    flows are a few packets per step between hosts on one switch, which is what pacing
    protects against least; loss recovery and the congestion window are untouched.
    """

    def update_rate(self, congestion_window: int, smoothed_rtt: float) -> None:
        self.packet_time = None


def unpace(quic: QuicConnection) -> bool:
    """Swap the connection's pacer for :class:`Unpaced`; False (still paced) when
    aioquic's recovery object or its pacer is not where it was.

    aioquic has no switch for pacing; its recovery object (``_loss``, private) owns the
    pacer (``_pacer``)."""
    loss = getattr(quic, "_loss", None)
    if not isinstance(getattr(loss, "_pacer", None), QuicPacketPacer):
        return False
    loss._pacer = Unpaced(max_datagram_size=max_datagram_size(quic))
    return True


def pacer(quic: QuicConnection) -> QuicPacketPacer:
    """The connection's pacer (the tests check that it is :class:`Unpaced`)."""
    return quic._loss._pacer


# ---- datagram size -------------------------------------------------------------------------

def max_datagram_size(quic: QuicConnection) -> int:
    """The largest UDP payload the connection builds now. Only the configuration's
    value is public, and it is read once when the connection is created."""
    return quic._max_datagram_size


def set_max_datagram_size(quic: QuicConnection, size: int) -> None:
    """Build datagrams of up to ``size`` bytes from now on (a peer on loopback, see
    ``PeerLink._size_datagrams``): aioquic has no public way to change it after the
    handshake, and the handshake must run at the configured (path-safe) size."""
    quic._max_datagram_size = size


# ---- TLS -----------------------------------------------------------------------------------

def request_client_certificate(quic: QuicConnection) -> None:
    """Make a server-side connection ask the client for its certificate.

    The client's certificate is its node identity. aioquic only asks for one when a
    private flag of the TLS context is set (it exists "for test purposes"), and that
    context is created lazily in ``QuicConnection._initialize``: so the flag is set right
    after that method ran, on this connection only."""
    orig_init = quic._initialize

    def _initialize(peer_cid: bytes) -> None:
        orig_init(peer_cid)
        quic.tls._request_client_certificate = True

    quic._initialize = _initialize  # type: ignore[method-assign]


def peer_certificate(quic: QuicConnection) -> Any:
    """The certificate the peer presented in the handshake (an ``x509.Certificate``),
    or None. aioquic verifies it (or not: ``CERT_NONE``) but keeps it private; the mesh
    derives the peer's node id and proof binding from it."""
    context = getattr(quic, "tls", None)
    return getattr(context, "_peer_certificate", None)


# ---- ACKs ------------------------------------------------------------------------------------

def one_rtt_ack_space(quic: QuicConnection) -> Any:
    """The 1-RTT packet space (holds ``ack_at``, when the pending ACK is due), or None
    when aioquic no longer keeps it where it did. Valid once the handshake completed."""
    space = getattr(quic, "_spaces", {}).get(tls.Epoch.ONE_RTT)
    return space if hasattr(space, "ack_at") else None


def ack_with_next_packet(space: Any, now: float) -> None:
    """Make the pending ACK of ``space`` due now, so the packet about to be built carries
    it. aioquic puts an ACK only into packets sent after its 1 ms ack delay (see
    ``PeerLink._ack_with_data`` for why replies should carry it)."""
    if space.ack_at is not None:
        space.ack_at = min(space.ack_at, now)


# ---- flow control and paths (limits before authentication) ----------------------------------

def received_stream_bytes(quic: QuicConnection) -> int:
    """Stream bytes the peer has sent us so far, counting every offset it reached: data
    delivered in order *and* data aioquic holds behind a gap. aioquic zero-fills a
    stream's buffer up to the highest offset received, so a single frame far into a stream
    costs that much memory without any event reaching the link; this counter (the
    connection-level flow-control use) is the only place that sees it."""
    return quic._local_max_data.used


def open_flow_control(quic: QuicConnection, max_data: int) -> None:
    """Raise the connection's receive window to ``max_data``; aioquic sends MAX_DATA with
    its next packet.

    A link starts with a small connection window, so that a peer that has not proved the
    mesh secret cannot make aioquic buffer much on all its streams together (aioquic
    checks it before it buffers a frame), and opens it once authenticated. aioquic has no
    public setter: its limits are read from the configuration once. (Stream windows keep
    their configured size: a stream the peer opens later starts at the transport
    parameter it was told, and aioquic announces only changes it made itself.)"""
    limit = quic._local_max_data
    limit.value = max(limit.value, max_data)


def validated_peer_address(quic: QuicConnection) -> Any:
    """The peer's address on a path QUIC has validated (the active one first), or None.

    The fast lane sends there: a datagram's source address is whatever the sender wrote,
    and aioquic switches its active path to a new address before validating it (RFC 9000
    allows it), so neither may steer lane traffic."""
    for path in quic._network_paths:
        if path.is_validated:
            return path.addr
    return None


def has_network_path(quic: QuicConnection) -> bool:
    """False for a client connection that ``connect()`` has not reached yet: aioquic
    creates the protocol (our link) a loop iteration before it, and asking such a
    connection for datagrams raises IndexError."""
    return bool(quic._network_paths)


# ---- the asyncio protocol ----------------------------------------------------------------

def feed_datagram(protocol: QuicConnectionProtocol, data: bytes, addr: Any, now: float) -> None:
    """What ``QuicConnectionProtocol.datagram_received`` does, minus its transmit: hand the
    datagram to the connection and dispatch the events it produced (to
    ``quic_event_received``). ``PeerLink.datagram_received`` defers the transmit."""
    protocol._quic.receive_datagram(data, addr, now=now)
    protocol._process_events()


def datagram_transport(protocol: QuicConnectionProtocol) -> asyncio.DatagramTransport | None:
    """The UDP socket's transport (None before ``connection_made``). The fast lane sends
    its packets there, beside QUIC's: same socket, same 5-tuple, same firewall path."""
    return protocol._transport


class ReadsConnectFailure(QuicConnectionProtocol):
    """A client protocol whose ``wait_connected()``, when cancelled, reads the error its
    waiter will get. aioquic awaits that future through ``asyncio.shield``, so a cancelled
    wait leaves it behind, and when the connection then ends aioquic sets ConnectionError
    on it; unread, asyncio logs "Future exception was never retrieved" (an ERROR line
    whenever a dial is given up during the handshake: a node's, a flood's stranger)."""

    async def wait_connected(self) -> None:
        try:
            await super().wait_connected()
        except asyncio.CancelledError:
            waiter = self._connected_waiter
            if waiter is not None:
                waiter.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise


def mark_closed(protocol: QuicConnectionProtocol) -> None:
    """Let ``wait_closed()`` return. aioquic sets it on ConnectionTerminated only; a link
    that gives up on its own (dead peer, transport lost) must release its dialler now."""
    protocol._closed.set()


class PrefilteredQuicServer(QuicServer):
    """aioquic's server protocol, with datagrams that are not QUIC taken off the socket
    before QUIC parses them: ``prefilter(data, addr)`` sees each datagram first and
    returns True when it took it (the fast lane's packets, see meshnode.net.lane).
    ``QuicServer`` is what aioquic's ``serve()`` builds; only the class is not public.

    ``admit(addr)``, when given, is asked before a datagram may create a connection (an
    Initial packet for a connection id the server does not know); False drops the
    datagram, so the connection is never created (the node's limits on handshakes in
    flight and connections per address). Only long-header packets can create one, so the
    1-RTT traffic of established links skips the header parse."""

    def __init__(self, prefilter: Callable[[bytes, Any], bool], *,
                 admit: Callable[[Any], bool] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._prefilter = prefilter
        self._admit = admit

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        if self._prefilter(data, addr):  # type: ignore[arg-type]
            return
        if self._admit is not None and data and data[0] & 0x80 and self._creates_connection(data) \
                and not self._admit(addr):
            return
        super().datagram_received(data, addr)

    def _creates_connection(self, data: bytes | str) -> bool:
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=self._configuration.connection_id_length)  # type: ignore[arg-type]
        except ValueError:
            return False
        return header.packet_type == QuicPacketType.INITIAL and header.destination_cid not in self._protocols

