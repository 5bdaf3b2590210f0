"""A stranger's QUIC client: what a host without the mesh secret can do to a node.

Theory of operation: :func:`stranger_connection` connects to a node the way any host on
the LAN can (its own fresh self-signed certificate, the mesh's ALPN, no secret), then
misbehaves in one of the ways docs/security.md guards against: it opens many streams and writes on
each a frame header declaring the largest frame (``MAX_FRAME``, 64 MiB), optionally
followed by payload bytes, or it sends a ``Hello`` whose fields are hostile, and then
holds the connection open. It reports how long the node let the connection live and why
it ended. ``meshnode bench flood`` (:mod:`meshnode.bench.flood_bench`) runs many of
them against a node; the tests in ``tests/test_net_preauth.py`` run a few.

It lives in ``meshnode.net`` because only this package imports aioquic. It is a tool
for measuring a node's defences on loopback, not part of a node.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from dataclasses import dataclass
from typing import Any

from aioquic.asyncio import connect
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration

from meshnode.net.aioquic_compat import ReadsConnectFailure
from meshnode.net.identity import Identity
from meshnode.net.link import ALPN
from meshnode.wire import MAGIC, MAX_FRAME, WIRE_VERSION, AuthChallenge, Hello, MessageKind, encode
from meshnode.wire.codec import HEADER

__all__ = ["StrangerResult", "oversize_header", "stranger_connection"]


@dataclass(frozen=True, slots=True)
class StrangerResult:
    connected: bool          # the QUIC handshake completed (False: refused or timed out)
    lived_s: float           # from the handshake to the node closing the connection (or hold_s)
    closed_by_node: bool     # the node closed it before we gave up
    reason: str              # the node's reason phrase, or why we could not connect
    streams: int             # streams we wrote on


def oversize_header(kind: int = MessageKind.FORWARD, length: int = MAX_FRAME) -> bytes:
    """A 10-byte frame header declaring ``length`` bytes of ``kind`` (no payload)."""
    return HEADER.pack(MAGIC, WIRE_VERSION, 0, kind, length)


class _Stranger(ReadsConnectFailure):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.terminated: events.ConnectionTerminated | None = None
        self.terminated_at: float | None = None

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.ConnectionTerminated) and self.terminated is None:
            self.terminated, self.terminated_at = event, time.monotonic()
        super().quic_event_received(event)


async def stranger_connection(host: str, port: int, *, streams: int = 20, payload: int = 0,
                              hello: Hello | None = None, hold_s: float = 5.0,
                              identity: Identity | None = None, connect_timeout_s: float = 2.0) -> StrangerResult:
    """Connect to ``host:port`` as a non-member and misbehave; see the module docstring.

    ``streams``: streams to open (the first is the control stream, bidirectional; the rest
    unidirectional), each carrying an oversize frame header and ``payload`` zero bytes.
    ``hello``: instead of the header on the control stream, send this Hello and a
    challenge (a handshake that never proves anything). Returns once the node closed the
    connection or ``hold_s`` passed."""
    ident = identity or Identity.generate()
    cfg = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], verify_mode=ssl.CERT_NONE,
                            idle_timeout=max(hold_s, 1.0) + 1.0)
    cfg.certificate, cfg.private_key = ident.certificate, ident.private_key
    t_start = time.monotonic()
    t0: float | None = None
    try:
        async with asyncio.timeout(connect_timeout_s + hold_s + 2.0) as budget:
            budget.reschedule(asyncio.get_running_loop().time() + connect_timeout_s)
            async with connect(host, port, configuration=cfg, create_protocol=_Stranger) as proto:
                budget.reschedule(asyncio.get_running_loop().time() + hold_s + 2.0)
                assert isinstance(proto, _Stranger)
                t0 = time.monotonic()
                quic, sent = proto._quic, 0
                for i in range(streams):
                    if proto.terminated is not None:
                        break
                    sid = quic.get_next_available_stream_id(is_unidirectional=i > 0)
                    if i == 0 and hello is not None:
                        data = encode(hello) + encode(AuthChallenge(ref=0, nonce=os.urandom(32)))
                    else:
                        data = oversize_header() + bytes(payload)
                    try:
                        quic.send_stream_data(sid, data)
                    except Exception:   # the connection closed under us, or flow control: stop
                        break
                    sent += 1
                    proto.transmit()
                    await asyncio.sleep(0)
                deadline = t0 + hold_s
                while proto.terminated is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                term = proto.terminated
                if term is None:
                    return StrangerResult(True, time.monotonic() - t0, False, "still open", sent)
                return StrangerResult(True, (proto.terminated_at or t0) - t0, True,
                                      term.reason_phrase or f"code {term.error_code}", sent)
    except (ConnectionError, OSError, TimeoutError) as exc:
        if t0 is not None:   # connected, then our own time budget ran out (a busy loop)
            return StrangerResult(True, time.monotonic() - t0, False, f"still open: {type(exc).__name__}", 0)
        return StrangerResult(False, time.monotonic() - t_start, False, f"not connected: {type(exc).__name__}", 0)
