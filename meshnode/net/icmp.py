"""The kernel's word that a peer's UDP port is closed: ICMP errors on the QUIC sockets.

Theory of operation. When a node's process dies (kill -9, a crash, the OOM killer) on a
host that stays up, the next datagram we send to its port makes that host answer with
ICMP "port unreachable". Linux hands such errors to an unconnected UDP socket only when
``IP_RECVERR`` / ``IPV6_RECVERR`` is set; then the socket polls readable with an error,
the event loop's next read fails with ``ECONNREFUSED`` (asyncio calls the protocol's
``error_received``), and the error, with the address the refused datagram went to,
waits in the socket's error queue until read with ``MSG_ERRQUEUE``. It *must* be read:
while the queue holds anything the socket keeps polling as ready, and the event loop
would spin.

What the link does with it (net/liveness.py, ``Liveness.unreachable``): an ICMP packet
is not authenticated (anyone on the LAN can forge one), so it is a hint, never a
verdict. The link sends a heartbeat at once and drops the peer only if nothing at all
arrives from it within ``LinkSettings.unreachable_s``; a live peer answers long before.
A crashed peer is then dropped well inside the 1.5 s of silence the watch waits for
otherwise.

Only "this address does not take datagrams" counts: port, host or network unreachable.
Everything else in the queue (e.g. "fragmentation needed" for a large fast-lane probe) is
read and ignored. Elsewhere than Linux nothing is enabled and nothing is read.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
import sys
from typing import Any

__all__ = ["UNREACHABLE_ERRNOS", "ErrorQueue", "unreachable_errno"]

log = logging.getLogger(__name__)

# <linux/in.h> IP_RECVERR, <linux/in6.h> IPV6_RECVERR (Python 3.11's socket module lacks both)
_IP_RECVERR = getattr(socket, "IP_RECVERR", 11)
_IPV6_RECVERR = getattr(socket, "IPV6_RECVERR", 25)
# (level, option) to set on a socket, and (level, type) of the error records it then gets
_RECVERR = ((socket.IPPROTO_IP, _IP_RECVERR), (socket.IPPROTO_IPV6, _IPV6_RECVERR))
# struct sock_extended_err { u32 ee_errno; u8 ee_origin, ee_type, ee_code, ee_pad; u32 ee_info, ee_data; }
_EXTENDED_ERR = struct.Struct("=IBBBBII")
_ORIGIN_ICMP, _ORIGIN_ICMP6 = 2, 3
UNREACHABLE_ERRNOS = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH})
_MAX_READS = 64      # queue entries read per call (the kernel bounds the queue by the socket's rcvbuf)


class ErrorQueue:
    """The ICMP errors of one datagram transport's socket (see the module doc).

    asyncio lends only a restricted view of a transport's socket (no ``recvmsg``), so
    this holds a duplicate of its descriptor: the same kernel socket, read with
    ``MSG_ERRQUEUE`` only. :meth:`close` it with the transport."""

    def __init__(self, transport: Any) -> None:
        self._sock: socket.socket | None = None
        view = transport.get_extra_info("socket") if transport is not None else None
        if view is None or sys.platform != "linux":
            return   # a dead peer is then noticed by its silence alone
        try:
            sock = socket.fromfd(view.fileno(), view.family, view.type)
        except OSError as exc:
            log.debug("no ICMP errors on this socket: %s", exc)
            return
        if _enable(sock):
            self._sock = sock
        else:
            sock.close()

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def read(self) -> list[tuple[str, int]]:
        """Empty the error queue; the ``(host, port)`` each refused datagram was sent to,
        for the "unreachable" errors among them (see the module doc)."""
        sock, out = self._sock, []
        if sock is None:
            return out
        for _ in range(_MAX_READS):
            try:
                _, ancdata, _, addr = sock.recvmsg(0, 256, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:   # (a closed socket: nothing more to read)
                log.debug("reading the error queue: %s", exc)
                break
            if unreachable_errno(ancdata) is not None and _is_address(addr):
                out.append((addr[0], addr[1]))
        return out

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _enable(sock: socket.socket) -> bool:
    done = False
    for level, opt in _RECVERR:
        try:   # an IPv6 socket takes both (IPv4-mapped peers); an IPv4 one only the first
            sock.setsockopt(level, opt, 1)
            done = True
        except OSError:
            pass
    return done


def unreachable_errno(ancdata: list[tuple[int, int, bytes]]) -> int | None:
    """The errno of an ICMP "unreachable" error in one error-queue message's ancillary
    data, or None for anything else (another error, a local one, a short record)."""
    for level, kind, data in ancdata:
        if (level, kind) not in _RECVERR:
            continue
        if len(data) < _EXTENDED_ERR.size:
            continue
        ee_errno, origin = _EXTENDED_ERR.unpack_from(data)[:2]
        if origin in (_ORIGIN_ICMP, _ORIGIN_ICMP6) and ee_errno in UNREACHABLE_ERRNOS:
            return ee_errno
    return None


def _is_address(addr: Any) -> bool:
    return isinstance(addr, tuple) and len(addr) >= 2 and isinstance(addr[0], str) and isinstance(addr[1], int)
