"""The bulk channel: file chunks over TLS 1.3 on TCP, for members holding a ticket.

Why not QUIC: aioquic moves 7-14 MB/s in one Python process; TLS 1.3 over TCP with the
``ssl`` module, blocking sockets and 8 MiB chunks moves hundreds of MB/s (the OpenSSL
calls release the GIL, so sender and receiver threads run beside the event loop).
docs/protocol.md ("Bulk channel") has the measured numbers.

Authentication. The server presents the node's own certificate (:mod:`meshnode.net.identity`).
A puller never dials it unprompted: it first asks over the authenticated QUIC link
(``ShareRequest``) and gets a ``ShareTicket`` carrying a random 32-byte ticket, the TCP port
and the SHA-256 fingerprint of the holder's certificate. The client pins that fingerprint
(the handshake is refused unless the server's certificate matches it and names the expected
node id), then presents the ticket. A ticket is single-use, expires after
:data:`TICKET_TTL_S`, is bound to the member it was issued to, one file and a chunk range;
only the holder and that member ever saw it, inside encrypted, authenticated channels.

Wire format after the TLS handshake (all integers big-endian):

* client -> server: the 32-byte ticket; server -> client: ``status u8`` (0 ok) and, when not
  ok, ``len u16`` + a UTF-8 message, then the server closes.
* then any number of requests: client ``index u32`` (``0xFFFFFFFF``: goodbye); server
  ``status u8`` 0 + ``length u64`` + the chunk's bytes, or status 1 + ``len u16`` + message
  (an index outside the ticket's range: refused, connection closed).

Bounds: at most :data:`MAX_CONNECTIONS` connections at once, at most
:data:`MAX_TICKETS` tickets outstanding; a connection has :data:`HANDSHAKE_TIMEOUT_S` for TLS
and its ticket, then every read has a :data:`IDLE_TIMEOUT_S` timeout. Connections over the
limit are closed at once (the puller's pull fails with "connection closed" and can be retried).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import socket
import ssl
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshnode.errors import MeshnodeError
from meshnode.limits import SOCKET_BUFFER
from meshnode.net.identity import CERT_FILE, KEY_FILE, node_id_of_cert

__all__ = ["BulkClient", "BulkError", "BulkServer", "Grant", "TicketBook", "TICKET_LEN"]

log = logging.getLogger(__name__)

TICKET_LEN = 32
TICKET_TTL_S = 60.0
MAX_TICKETS = 256
MAX_CONNECTIONS = 8
IDLE_TIMEOUT_S = 30.0
HANDSHAKE_TIMEOUT_S = 5.0     # TLS and the ticket, before a connection is a transfer
MAX_MESSAGE = 512
BYE = 0xFFFFFFFF


class BulkError(MeshnodeError):
    """A bulk transfer failed (refused, pin mismatch, connection lost)."""


@dataclass(frozen=True, slots=True)
class Grant:
    """What one ticket allows: chunks [first, last) of ``path`` to ``node_id``."""

    node_id: str
    path: Path
    size: int
    chunk_size: int
    first: int
    last: int
    expires: float

    def span(self, index: int) -> tuple[int, int]:
        off = index * self.chunk_size
        return off, min(self.chunk_size, self.size - off)


class TicketBook:
    """Issued tickets (sans-IO: every call takes ``now``). Thread-safe."""

    def __init__(self, ttl: float = TICKET_TTL_S, max_tickets: int = MAX_TICKETS) -> None:
        self.ttl = ttl
        self.max_tickets = max_tickets
        self._tickets: OrderedDict[bytes, Grant] = OrderedDict()
        self._lock = threading.Lock()

    def issue(self, node_id: str, path: Path, size: int, chunk_size: int, first: int, last: int,
              now: float) -> bytes:
        ticket = secrets.token_bytes(TICKET_LEN)
        with self._lock:
            self._expire(now)
            while len(self._tickets) >= self.max_tickets:
                self._tickets.popitem(last=False)   # the oldest: a flood only hurts its sender
            self._tickets[ticket] = Grant(node_id, path, size, chunk_size, first, last, now + self.ttl)
        return ticket

    def take(self, ticket: bytes, now: float) -> Grant | None:
        """The grant of ``ticket`` (single use: it is gone afterwards), or None."""
        with self._lock:
            self._expire(now)
            return self._tickets.pop(bytes(ticket), None)

    def _expire(self, now: float) -> None:
        for t in [t for t, g in self._tickets.items() if g.expires <= now]:
            del self._tickets[t]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise BulkError("connection closed")
        got += k
    return bytes(buf)


def _send_error(sock: socket.socket, message: str) -> None:
    data = message.encode()[:MAX_MESSAGE]
    with contextlib.suppress(OSError):
        sock.sendall(struct.pack(">BH", 1, len(data)) + data)


def _read_error(sock: socket.socket) -> str:
    (n,) = struct.unpack(">H", _recv_exact(sock, 2))
    if n > MAX_MESSAGE:
        raise BulkError("oversized error message from the holder")
    return _recv_exact(sock, n).decode(errors="replace")


class BulkServer:
    """Serves chunks to ticket holders on a TCP port (module docstring). Threads: one
    accepting, one per connection (at most :data:`MAX_CONNECTIONS`)."""

    def __init__(self, identity_dir: Path, tickets: TicketBook, *, host: str = "",
                 port: int = 0, max_connections: int = MAX_CONNECTIONS) -> None:
        self.tickets = tickets
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        self._ctx.load_cert_chain(identity_dir / CERT_FILE, identity_dir / KEY_FILE)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._sock = self._bind(host, port)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.on_served: Callable[[str, int], None] | None = None   # (node_id, bytes) per chunk
        self._thread = threading.Thread(target=self._accept_loop, name="bulk-accept", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(host: str, port: int) -> socket.socket:
        """The node's port number on TCP when free, else any port (the ticket names it)."""
        for p in ((port, 0) if port else (0,)):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, p))
            except OSError:
                s.close()
                continue
            s.listen(16)
            return s
        raise BulkError(f"cannot listen on TCP port {port}")

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            for c in list(self._conns):
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=2.0)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)
                continue
            if not self._slots.acquire(blocking=False):
                # no thread and no TLS for a connection over the limit: a flood costs nothing
                with contextlib.suppress(OSError):
                    conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, addr), name="bulk-serve", daemon=True).start()

    def _serve(self, conn: socket.socket, addr: object) -> None:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)   # a slot is not held long by one without a ticket
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._ctx.wrap_socket(conn, server_side=True) as tls:
                with self._lock:
                    self._conns.add(tls)
                try:
                    self._session(tls)
                finally:
                    with self._lock:
                        self._conns.discard(tls)
        except (OSError, ssl.SSLError, BulkError) as exc:
            log.debug("bulk connection from %s ended: %s", addr, exc)
        finally:
            self._slots.release()
            with contextlib.suppress(OSError):
                conn.close()

    def _session(self, tls: ssl.SSLSocket) -> None:
        grant = self.tickets.take(_recv_exact(tls, TICKET_LEN), time.monotonic())
        if grant is None:
            _send_error(tls, "unknown or expired ticket (ask the holder for a new one over the mesh link)")
            return
        tls.settimeout(IDLE_TIMEOUT_S)
        try:
            fd = os.open(grant.path, os.O_RDONLY)
        except OSError as exc:
            _send_error(tls, f"the file is gone: {exc.strerror}")
            return
        try:
            tls.sendall(b"\x00")
            buf = bytearray(grant.chunk_size)
            while True:
                (index,) = struct.unpack(">I", _recv_exact(tls, 4))
                if index == BYE:
                    return
                if not grant.first <= index < grant.last:
                    _send_error(tls, f"chunk {index} is outside the ticket's range [{grant.first}, {grant.last})")
                    return
                off, n = grant.span(index)
                view = memoryview(buf)[:n]
                got = 0
                while got < n:
                    k = os.preadv(fd, [view[got:]], off + got)
                    if k == 0:
                        break
                    got += k
                if got != n:
                    _send_error(tls, "the file is shorter than its manifest")
                    return
                tls.sendall(struct.pack(">BQ", 0, n))
                tls.sendall(view)
                if self.on_served is not None:
                    self.on_served(grant.node_id, n)
        finally:
            os.close(fd)


class BulkClient:
    """One connection to a holder, pinned to its certificate (module docstring). Blocking."""

    def __init__(self, host: str, port: int, cert_sha256: bytes, node_id: str, ticket: bytes, *,
                 timeout: float = IDLE_TIMEOUT_S) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE     # self-signed node certificates: pinned below instead
        try:
            raw = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise BulkError(f"cannot reach {host}:{port}: {exc}") from exc
        try:
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = ctx.wrap_socket(raw)
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            raise BulkError(f"TLS to {host}:{port} failed: {exc}") from exc
        try:
            der = self.sock.getpeercert(binary_form=True) or b""
            if hashlib.sha256(der).digest() != cert_sha256:
                raise BulkError(f"{host}:{port} presented another certificate than node {node_id}'s")
            from cryptography import x509

            if node_id_of_cert(x509.load_der_x509_certificate(der)) != node_id:
                raise BulkError(f"{host}:{port} is not node {node_id}")
            self.sock.sendall(ticket)
            status = _recv_exact(self.sock, 1)
            if status != b"\x00":
                raise BulkError(f"refused by the holder: {_read_error(self.sock)}")
        except (OSError, ssl.SSLError, BulkError) as exc:
            self.close()
            raise exc if isinstance(exc, BulkError) else BulkError(str(exc)) from exc

    def fetch(self, index: int, expected: int, buf: bytearray) -> memoryview:
        """Chunk ``index`` (``expected`` bytes at most) read into ``buf``."""
        self.request(index)
        return self.receive(expected, buf)

    def request(self, index: int) -> None:
        """Ask for chunk ``index``; its bytes are read by the matching :meth:`receive`
        (requests may run ahead: the holder answers them in order)."""
        try:
            self.sock.sendall(struct.pack(">I", index))
        except (OSError, ssl.SSLError) as exc:
            raise BulkError(f"connection lost: {exc}") from exc

    def receive(self, expected: int, buf: bytearray) -> memoryview:
        """The answer to the oldest request not received yet (``expected`` bytes at most),
        read into ``buf``."""
        try:
            status = _recv_exact(self.sock, 1)
            if status != b"\x00":
                raise BulkError(f"refused by the holder: {_read_error(self.sock)}")
            (n,) = struct.unpack(">Q", _recv_exact(self.sock, 8))
            if n > expected or n > len(buf):
                raise BulkError(f"holder sent {n} bytes for a chunk of {expected}")
            view = memoryview(buf)[:n]
            got = 0
            while got < n:
                k = self.sock.recv_into(view[got:], n - got)
                if k == 0:
                    raise BulkError("connection closed mid-chunk")
                got += k
            return view
        except (OSError, ssl.SSLError) as exc:
            raise BulkError(f"connection lost: {exc}") from exc

    def close(self) -> None:
        with contextlib.suppress(OSError, ssl.SSLError):
            self.sock.sendall(struct.pack(">I", BYE))
        with contextlib.suppress(OSError):
            self.sock.close()
