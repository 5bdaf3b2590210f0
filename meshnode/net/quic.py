"""Where the mesh's QUIC connections come from: the listener and the dialler.

Theory of operation: every node listens on one UDP port (:func:`listen`) and dials its
peers from fresh sockets (:func:`dial`); either way the connection is driven by a
:class:`~meshnode.net.link.PeerLink`, owned by a :class:`~meshnode.net.link.LinkOwner`
(the fabric), which decides membership. Both ends present their node certificate; the
server asks for the client's (see :func:`meshnode.net.aioquic_compat.request_client_certificate`).

The listening socket also receives the fast lane's packets (:mod:`meshnode.net.lane`):
they are told from QUIC by their first byte and handed to the owner, which finds the link
by the packet's key id, before aioquic's server parses anything. A dialled link's own
socket does the same in :meth:`PeerLink.datagram_received`.

Before a peer proved the mesh secret it gets little (docs/security.md): small receive windows
(a connection window of ``LinkSettings.handshake_window``, opened once the link
authenticated), and the listener
admits a new connection only while fewer than ``max_handshakes`` connections are still
authenticating, fewer than ``max_handshakes_per_host`` of them from the same address, and
fewer than ``max_links_per_host`` connections of any state come from there
(:class:`Admission`). A refused Initial packet is dropped before aioquic creates
anything for it; the peer's handshake times out, and a member retries later.

This is the only place that opens QUIC sockets; :mod:`meshnode.mesh` uses only these
functions and :class:`PeerLink`'s own methods.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from aioquic.asyncio import connect
from aioquic.quic.configuration import QuicConfiguration

from meshnode.net import icmp
from meshnode.net.aioquic_compat import PrefilteredQuicServer
from meshnode.net.identity import Identity
from meshnode.net.lane import is_lane_packet
from meshnode.net.link import ALPN, LinkOwner, LinkSettings, PeerLink, enlarge_socket_buffers

__all__ = ["Admission", "QuicListener", "dial", "listen", "quic_configuration"]

log = logging.getLogger(__name__)
REFUSAL_LOG_EVERY_S = 10.0   # refused connections are logged at most this often (a flood must not flood the log)


def quic_configuration(identity: Identity, *, is_client: bool, settings: LinkSettings) -> QuicConfiguration:
    """The QUIC configuration of one side of a link: our certificate, no CA check (the
    mesh proof authenticates the peer), the link's idle timeout and datagram size, and
    the small receive windows of the handshake (the link opens them once authenticated,
    see ``PeerLink._flush_auth``)."""
    cfg = QuicConfiguration(
        is_client=is_client,
        alpn_protocols=[ALPN],
        idle_timeout=settings.idle_timeout_s,
        max_datagram_size=settings.max_datagram_size,
        verify_mode=ssl.CERT_NONE,
        max_data=settings.handshake_window,
        max_stream_data=settings.max_stream_data,
    )
    cfg.certificate = identity.certificate
    cfg.private_key = identity.private_key
    return cfg


class QuicListener:
    """The node's QUIC server socket: accepts links for its owner."""

    def __init__(self, transport: asyncio.DatagramTransport, server: PrefilteredQuicServer,
                 admission: Admission) -> None:
        self._transport = transport
        self._server = server
        self.admission = admission

    @property
    def port(self) -> int:
        """The bound UDP port."""
        return self._transport.get_extra_info("sockname")[1]

    def close(self) -> None:
        """Close every accepted connection and the socket."""
        self._server.close()


class Admission:
    """Which new connections the listener accepts; see the module docstring.

    Counts the server-side links it was told about (:meth:`created`) that are still open,
    at the moment a new connection would be created (rare: once per handshake)."""

    def __init__(self, settings: LinkSettings) -> None:
        self.settings = settings
        self.links: set[PeerLink] = set()
        self.refused = 0
        self._logged_at = -REFUSAL_LOG_EVERY_S

    def created(self, link: PeerLink) -> PeerLink:
        self.links.add(link)
        return link

    def unreachable(self, addr: tuple[str, int]) -> None:
        """A datagram to ``addr`` was refused (ICMP): tell the link of that peer."""
        for link in list(self.links):
            if link.remote_addr == addr:
                link.unreachable()

    def admit(self, addr: Any) -> bool:
        self.links = {link for link in self.links if link.closed_reason is None}
        host = addr[0] if addr else "?"
        s = self.settings
        pending = [link for link in self.links if not link.authenticated]
        from_host = [link for link in self.links if link.remote_addr is not None and link.remote_addr[0] == host]
        why = None
        if len(pending) >= s.max_handshakes:
            why = f"{len(pending)} handshakes in flight"
        elif sum(not link.authenticated for link in from_host) >= s.max_handshakes_per_host:
            why = f"{s.max_handshakes_per_host} handshakes in flight from {host}"
        elif len(from_host) >= s.max_links_per_host:
            why = f"{len(from_host)} connections from {host}"
        if why is None:
            return True
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at >= REFUSAL_LOG_EVERY_S:
            self._logged_at = now
            log.warning("refusing QUIC connections (%s so far): %s", self.refused, why)
        return False


class _Server(PrefilteredQuicServer):
    """The listener's protocol: aioquic's server, plus the ICMP errors of its socket
    (meshnode.net.icmp), each handed to the accepted link whose peer address it names."""

    def __init__(self, *, admission: Admission, **kwargs: Any) -> None:
        super().__init__(admit=admission.admit, **kwargs)
        self._admission = admission
        self._errors: icmp.ErrorQueue | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        enlarge_socket_buffers(transport)
        self._errors = icmp.ErrorQueue(transport)

    def error_received(self, exc: Exception) -> None:
        if self._errors is not None:
            for addr in self._errors.read():
                self._admission.unreachable(addr)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._errors is not None:
            self._errors.close()
        super().connection_lost(exc)


def _lane_prefilter(owner: LinkOwner) -> Callable[[bytes, Any], bool]:
    def take_lane_packet(data: bytes, addr: Any) -> bool:
        if not is_lane_packet(data):
            return False
        owner.lane_datagram(data, addr)
        return True

    return take_lane_packet


async def listen(owner: LinkOwner, host: str, port: int) -> QuicListener:
    """Listen for QUIC links on ``host:port`` (port 0: any); each accepted connection
    becomes a server-side :class:`PeerLink` of ``owner``."""
    admission = Admission(owner.settings)
    transport, server = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: _Server(
            prefilter=_lane_prefilter(owner),
            admission=admission,
            configuration=quic_configuration(owner.identity, is_client=False, settings=owner.settings),
            create_protocol=lambda quic, **kw: admission.created(PeerLink(quic, owner=owner, is_client=False, **kw)),
        ),
        local_addr=(host, port),
    )
    return QuicListener(transport, server, admission)  # type: ignore[arg-type]


@asynccontextmanager
async def dial(owner: LinkOwner, host: str, port: int) -> AsyncIterator[PeerLink]:
    """Connect to ``host:port``; yields the client-side :class:`PeerLink` once the QUIC
    handshake completed (the mesh authentication may still be running) and closes it on
    exit. Raises ``ConnectionError`` / ``OSError`` when the connection fails."""
    cfg = quic_configuration(owner.identity, is_client=True, settings=owner.settings)
    made: list[PeerLink] = []

    def create(quic: Any, **kw: Any) -> PeerLink:
        made.append(PeerLink(quic, owner=owner, is_client=True, dial_address=(host, port), **kw))
        return made[0]

    try:
        async with connect(host, port, configuration=cfg, wait_connected=True, create_protocol=create) as link:
            assert isinstance(link, PeerLink)
            yield link
    except ConnectionError as exc:
        if type(exc) is not ConnectionError or str(exc):
            raise   # (the caller's own, from inside the block)
        # aioquic's failed handshake is a bare ConnectionError; the link knows why it gave
        # up (e.g. "port unreachable")
        raise ConnectionError((made[0].closed_reason if made else None) or "no QUIC handshake") from exc
