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

This is the only place that opens QUIC sockets; :mod:`meshnode.mesh` uses only these
functions and :class:`PeerLink`'s own methods.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from aioquic.asyncio import connect
from aioquic.quic.configuration import QuicConfiguration

from meshnode.net.aioquic_compat import PrefilteredQuicServer
from meshnode.net.identity import Identity
from meshnode.net.lane import is_lane_packet
from meshnode.net.link import ALPN, LinkOwner, LinkSettings, PeerLink

__all__ = ["QuicListener", "dial", "listen", "quic_configuration"]


def quic_configuration(identity: Identity, *, is_client: bool, settings: LinkSettings) -> QuicConfiguration:
    """The QUIC configuration of one side of a link: our certificate, no CA check (the
    mesh proof authenticates the peer), the link's idle timeout and datagram size."""
    cfg = QuicConfiguration(
        is_client=is_client,
        alpn_protocols=[ALPN],
        idle_timeout=settings.idle_timeout_s,
        max_datagram_size=settings.max_datagram_size,
        verify_mode=ssl.CERT_NONE,
        max_data=64 << 20,
        max_stream_data=16 << 20,
    )
    cfg.certificate = identity.certificate
    cfg.private_key = identity.private_key
    return cfg


class QuicListener:
    """The node's QUIC server socket: accepts links for its owner."""

    def __init__(self, transport: asyncio.DatagramTransport, server: PrefilteredQuicServer) -> None:
        self._transport = transport
        self._server = server

    @property
    def port(self) -> int:
        """The bound UDP port."""
        return self._transport.get_extra_info("sockname")[1]

    def close(self) -> None:
        """Close every accepted connection and the socket."""
        self._server.close()


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
    transport, server = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: PrefilteredQuicServer(
            _lane_prefilter(owner),
            configuration=quic_configuration(owner.identity, is_client=False, settings=owner.settings),
            create_protocol=lambda quic, **kw: PeerLink(quic, owner=owner, is_client=False, **kw),
        ),
        local_addr=(host, port),
    )
    return QuicListener(transport, server)  # type: ignore[arg-type]


@asynccontextmanager
async def dial(owner: LinkOwner, host: str, port: int) -> AsyncIterator[PeerLink]:
    """Connect to ``host:port``; yields the client-side :class:`PeerLink` once the QUIC
    handshake completed (the mesh authentication may still be running) and closes it on
    exit. Raises ``ConnectionError`` / ``OSError`` when the connection fails."""
    cfg = quic_configuration(owner.identity, is_client=True, settings=owner.settings)
    async with connect(
        host, port, configuration=cfg, wait_connected=True,
        create_protocol=lambda quic, **kw: PeerLink(
            quic, owner=owner, is_client=True, dial_address=(host, port), **kw),
    ) as link:
        assert isinstance(link, PeerLink)
        yield link
