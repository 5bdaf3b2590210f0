"""One QUIC connection to one peer: the thin asyncio adapter over aioquic.

Theory of operation: :class:`PeerLink` is an aioquic ``QuicConnectionProtocol``. Both
ends present their self-signed certificates (the server asks for the client's; no CA
check, ``verify_mode=CERT_NONE``). When the TLS handshake completes, the link reads
the peer's certificate from the TLS context, and runs the sans-IO
:class:`~meshnode.net.auth.AuthHandshake` over the *control stream* (the client's
first bidirectional stream). Until that handshake succeeds every other message closes
the connection. After it:

* the control stream carries control messages and heartbeats (every
  ``heartbeat_s``; the echo gives the RTT);
* each ``(stream_key)`` of :meth:`send_data` gets its own unidirectional stream, so
  a session's activations stay ordered and never wait behind control traffic;
* every stream has its own :class:`~meshnode.wire.FrameDecoder`; a fatal framing error
  closes the connection, a non-fatal one is answered with ``Error(ref, code)``.

Per-token frames may also take the *fast lane* (:mod:`meshnode.net.lane`): after
authentication each end sends its lane key (``LaneKey``) on the control stream, probes the
lane, and :meth:`PeerLink.send_lane` then seals a frame into one UDP datagram on this
connection's socket. Lane packets are told from QUIC by their first byte.

Before the peer proved the mesh secret (docs/security.md) the link holds little for it: only the
control stream may carry data (any other stream closes the connection), its frames are
fed one at a time under a cap of ``handshake_max_frame`` (a bigger one, or a bad frame,
closes the connection), the connection may send at most ``handshake_max_bytes`` of
stream data (counted at the highest offset reached, so data held behind a gap counts),
and the connection's receive window stays small (``handshake_window``). Once the peer's proof
verified the Profile may take up to ``PROFILE_MAX_FRAME``; once authenticated the
window opens, frames may take ``MAX_FRAME``, and the peer is held to
``peer_buffer_budget``: bytes buffered across its streams (frames in progress, and what
aioquic holds behind gaps). Over it, the link closes with a logged reason.

A peer is declared gone when no byte arrived for ``dead_after_s`` (heartbeat watchdog)
or QUIC's idle timeout fires, whichever comes first. The owner (the fabric) gets
callbacks for authenticated / message / closed; the link never decides membership.

The link is a thin adapter, the way aioquic's asyncio protocol drives its sans-IO
``QuicConnection``: the decisions live in sans-IO objects that it feeds with events and
the loop's time, and whose answers it carries out:

* :class:`~meshnode.net.liveness.Liveness`: the authentication deadline, the heartbeat
  and the dead-peer watch (one asyncio timer, re-armed after each event);
* :class:`~meshnode.net.lane_control.LaneControl`: the fast lane's probing, readiness,
  misses, switch-off and backoff;
* :class:`~meshnode.net.auth.AuthHandshake`: the mesh proof.

Every use of aioquic's private attributes goes through :mod:`meshnode.net.aioquic_compat`;
sockets are opened in :mod:`meshnode.net.quic`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from aioquic.quic import events
from aioquic.quic.connection import QuicConnection

from meshnode import timeline
from meshnode.limits import SOCKET_BUFFER
from meshnode.net import aioquic_compat as compat, icmp
from meshnode.net.auth import AuthHandshake, AuthState, NONCE_LEN
from meshnode.net.identity import Identity, cert_fingerprint, node_id_of_cert
from meshnode.net.lane import (HEADER_SIZE as LANE_HEADER_SIZE, TAG_SIZE as LANE_TAG_SIZE, LaneDrop, LaneReceiver,
                               LaneSender, is_lane_packet)
from meshnode.net.lane_control import LANE_LOSS_WINDOW, LaneControl
from meshnode.net.liveness import AuthTimedOut, Liveness, LivenessAction, PeerSilent, PeerUnreachable, SendHeartbeat
from meshnode.wire import (HEADER_SIZE, MAX_FRAME, DecoderState, Error, Forward, FrameDecoder, Heartbeat, Hello, LaneKey, Message,
                           RemoteProtocolError, TokenReturn, WireError, decode, encode, parse_header)

log = logging.getLogger(__name__)

ALPN = "meshnode/1"
_LANE_KINDS = (Heartbeat, Forward, TokenReturn)   # what may arrive on the lane
DEFERRED_TRANSMIT_S = 0.001   # after a received datagram (see PeerLink.datagram_received)
# Largest frame sent on the lane: what one IPv4 UDP datagram carries (65,507 bytes) less the
# lane's header and tag, so a decode row of any model up to 16,000 wide in f32 takes it (an
# 8B's 4096-wide row is 16.4 KB, a 70B's 32.8 KB; above this width, over QUIC). Over a
# 1500-byte LAN such a datagram travels as IP fragments, so probes are this big: a path that
# drops fragments never gets a lane.
LANE_MAX_FRAME = 65_507 - LANE_HEADER_SIZE - LANE_TAG_SIZE
# A Profile (name and capabilities, after the peer's proof): meshnode.net.auth caps its JSON
# at 64 KiB; the rest of the frame is a name and a few lengths.
PROFILE_MAX_FRAME = 64 * 1024 + 512


def enlarge_socket_buffers(transport: asyncio.BaseTransport) -> None:
    """Ask the kernel for SOCKET_BUFFER bytes of receive and send buffer on ``transport``'s
    socket (limits.py says why; granted up to the OS's cap, a refusal is logged at debug
    level and changes nothing else)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError as exc:
            log.debug("socket buffer %s not enlarged: %s", opt, exc)


@dataclass(frozen=True, slots=True)
class LinkSettings:
    # Failure detection (docs/mesh.md, "Failure detection", derives these): a peer is
    # dropped after dead_after_s without a byte; QUIC's idle timeout is only a backstop.
    idle_timeout_s: float = 4.0      # QUIC idle timeout
    heartbeat_s: float = 0.3         # Heartbeat period on the control stream
    dead_after_s: float = 1.5        # silence after which the peer is dropped
    # ... or after this much of it following an ICMP "unreachable" for the peer's address
    # (a crashed process on a host that stays up; net/icmp.py): a hint, so a live peer
    # (which answers the heartbeat sent at once within a round trip) is never dropped by it
    unreachable_s: float = 0.5
    auth_timeout_s: float = 3.0      # TLS + mesh proof must finish within this
    max_datagram_size: int = 1350    # safe on a 1500-byte MTU LAN (and through most tunnels)
    # Datagrams to a peer on this host (loopback: 64 KiB MTU, no fragmentation). An f32
    # SmolLM2 activation is one datagram instead of two; see PeerLink._size_datagrams.
    loopback_datagram_size: int = 16384
    # The fast lane for per-token frames (meshnode.net.lane); off: everything over QUIC.
    lane: bool = True
    lane_backoff_s: float = 5.0      # a lane switched off waits this long, doubling each time, to probe again
    # Limits before the peer proved the mesh secret (see the module docstring)
    handshake_max_frame: int = 4096          # Hello, AuthChallenge, AuthProof, AuthResult, Error
    handshake_max_bytes: int = 32 * 1024     # stream bytes a connection may send before its proof
    handshake_window: int = 64 * 1024        # QUIC connection receive window until authenticated
    max_handshakes: int = 32                 # server: connections still authenticating
    max_handshakes_per_host: int = 4         # server: ... of them from one address
    max_links_per_host: int = 64             # server: connections from one address, any state
    # After authentication
    max_data: int = 64 << 20                 # QUIC receive window of the connection
    max_stream_data: int = 16 << 20          # QUIC receive window of each stream
    peer_buffer_budget: int = 256 << 20      # bytes buffered for one peer across its streams (4 max frames)


class LinkOwner(Protocol):
    identity: Identity
    settings: LinkSettings

    def make_hello(self) -> Hello: ...
    def make_auth(self, link: "PeerLink", **kwargs: Any) -> AuthHandshake: ...
    def link_created(self, link: "PeerLink") -> None: ...
    def link_authenticated(self, link: "PeerLink") -> None: ...
    def link_message(self, link: "PeerLink", msg: Message) -> None: ...
    def lane_receiver(self, link: "PeerLink") -> LaneReceiver: ...
    def lane_datagram(self, data: bytes, addr: Any) -> None: ...
    def link_closed(self, link: "PeerLink", reason: str) -> None: ...


class _RateMeter:
    """Bytes per second, smoothed over roughly one second."""

    def __init__(self) -> None:
        self.total = 0
        self._last_total = 0
        self._last_t = time.monotonic()
        self.rate = 0.0

    def tick(self, now: float) -> None:
        dt = now - self._last_t
        if dt <= 0:
            return
        inst = (self.total - self._last_total) / dt
        a = min(1.0, dt / 1.0)
        self.rate = (1 - a) * self.rate + a * inst
        self._last_total, self._last_t = self.total, now


def _is_loopback(host: str) -> bool:
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


class PeerLink(compat.ReadsConnectFailure):
    """A QUIC connection to one peer (client or server side)."""

    def __init__(self, quic: QuicConnection, *, owner: LinkOwner, is_client: bool,
                 dial_address: tuple[str, int] | None = None, **kwargs: Any) -> None:
        self._deferred_tx: asyncio.TimerHandle | None = None   # see datagram_received
        self.lane_rx: LaneReceiver | None = None               # our key, once sent (see _start_lane)
        self._lane_tx: LaneSender | None = None                # the peer's key, once received
        self.lane = LaneControl(owner.settings.lane_backoff_s)  # when the lane may be used
        super().__init__(quic, **kwargs)
        self.quic = quic                                       # the sans-IO connection we drive
        self._event_loop = asyncio.get_running_loop()
        self.owner = owner
        self.is_client = is_client
        self.remote_addr: tuple[str, int] | None = dial_address
        self.peer_node_id: str | None = None
        self.auth: AuthHandshake | None = None
        self.closed_reason: str | None = None
        self.rtt_ms: float | None = None
        self.rx = _RateMeter()
        self.tx = _RateMeter()
        self._control_sid: int | None = None
        self._data_sids: dict[Any, int] = {}
        self._decoders: dict[int, FrameDecoder] = {}
        self._delivered = 0     # stream bytes aioquic handed us (in order); see _check_budget
        self._buffered = 0      # bytes our decoders hold for frames in progress
        s = owner.settings
        self.liveness = Liveness(heartbeat_s=s.heartbeat_s, dead_after_s=s.dead_after_s,
                                 auth_timeout_s=s.auth_timeout_s, now=self._event_loop.time(),
                                 unreachable_s=s.unreachable_s)
        self._errors: icmp.ErrorQueue | None = None            # a dialled link's own socket's ICMP errors
        self._watch: asyncio.TimerHandle | None = None         # the one timer of self.liveness
        self._watch_at: float | None = None
        self._ref = 0
        self._notified_closed = False
        # aioquic's 1-RTT packet space, once the handshake completed: set, it also turns on
        # the deferred transmit after a received datagram (both tune the same exchange)
        self._ack_space: Any = None
        # Should a later aioquic move its pacer, the link still works, only paced.
        if not compat.unpace(quic):
            log.debug("aioquic's pacer not found; this link stays paced")
        if not is_client:
            compat.request_client_certificate(quic)   # the client's certificate is its identity
        self._arm_watch()
        owner.link_created(self)

    # ---- state ---------------------------------------------------------------

    @property
    def lane_ready(self) -> bool:
        """True when frames may take the fast lane now (a probe came back over it)."""
        return self.lane.ready

    @property
    def authenticated(self) -> bool:
        return self.auth is not None and self.auth.state is AuthState.AUTHENTICATED and self.closed_reason is None

    @property
    def address(self) -> str:
        """``host:port`` of the peer's QUIC endpoint (its advertised port once known).
        Never raises: it goes into the log lines of failures."""
        host = self.remote_addr[0] if self.remote_addr else "?"
        port = self.remote_addr[1] if self.remote_addr else 0
        peer = self.auth.peer if self.auth is not None else None
        advertised = peer.capabilities.get("quic_port") if peer is not None else None
        if isinstance(advertised, int) and not isinstance(advertised, bool) and 1 <= advertised <= 65535:
            port = advertised
        return f"{host}:{port}"

    def next_ref(self) -> int:
        """A fresh request id. The two ends of a link use disjoint ids (odd for the
        lower node id, even for the higher), so our requests never collide with the
        peer's."""
        self._ref += 1
        low = self.owner.identity.node_id < (self.peer_node_id or "")
        return ((self._ref * 2 + (1 if low else 0)) & 0xFFFFFFFF) or 2

    # ---- sending -------------------------------------------------------------

    def send(self, msg: Message) -> None:
        """Queue ``msg`` on the control stream (raises ConnectionError when closed)."""
        self._send_on(self._control_stream(), encode(msg))

    def send_data(self, msg: Message, stream_key: Hashable) -> None:
        """Queue ``msg`` on the data stream for ``stream_key`` (opened on first use).

        ``msg`` may also be an already encoded frame (the per-session decode template)."""
        sid = self._data_sids.get(stream_key)
        if sid is None:
            sid = self.quic.get_next_available_stream_id(is_unidirectional=True)
            self._data_sids[stream_key] = sid
        self._send_on(sid, msg if isinstance(msg, (bytes, bytearray, memoryview)) else encode(msg))

    def close_data_stream(self, stream_key: Any) -> None:
        sid = self._data_sids.pop(stream_key, None)
        if sid is not None and self.closed_reason is None:
            self.quic.send_stream_data(sid, b"", end_stream=True)
            self.transmit()

    def close_with(self, reason: str, delay: float = 0.0) -> None:
        """Close the connection (after ``delay`` s so queued messages can leave)."""
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self.close_with, reason)
            return
        if self.closed_reason is None:
            self.closed_reason = reason
        self._release_buffers()
        self.quic.close(error_code=0, reason_phrase=reason[:200])
        self.transmit()

    def _release_buffers(self) -> None:
        """A closing link keeps no frame in progress (aioquic may keep the connection
        object a while for its closing state)."""
        self._decoders.clear()
        self._buffered = 0

    def _close_later(self, delay: float) -> None:
        def _close() -> None:
            self.quic.close(error_code=0, reason_phrase=(self.closed_reason or "")[:200])
            self.transmit()

        asyncio.get_running_loop().call_later(delay, _close)

    def _control_stream(self) -> int:
        if self._control_sid is None:
            if not self.is_client:
                raise ConnectionError("control stream not open yet")
            self._control_sid = self.quic.get_next_available_stream_id()
        return self._control_sid

    def _send_on(self, sid: int, data: bytes) -> None:
        if self.closed_reason is not None:
            raise ConnectionError(f"link closed: {self.closed_reason}")
        self._ack_with_data()
        self.quic.send_stream_data(sid, data)
        self.tx.total += len(data)
        self.transmit()

    def transmit(self) -> None:
        if self._deferred_tx is not None:
            self._deferred_tx.cancel()
            self._deferred_tx = None
        if not compat.has_network_path(self.quic):
            # a dial closed before it started (the node stopping): nothing was sent, so
            # nothing is owed to the peer; the dialler's wait_closed() must not hang
            if self.closed_reason is not None:
                compat.mark_closed(self)
            return
        super().transmit()

    # ---- aioquic events --------------------------------------------------------

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        if is_lane_packet(data):   # a dialled link's own socket (the server's: meshnode.net.quic)
            self.owner.lane_datagram(data, addr)
            return
        if self.remote_addr is None:
            self.remote_addr = (addr[0], addr[1])
        compat.feed_datagram(self, data, addr, now=self._event_loop.time())
        self._check_budget()
        if self._ack_space is None:   # the handshake: aioquic's own pace
            self.transmit()
            return
        # aioquic transmits right here; after the handshake that mostly builds nothing
        # (the ACK waits for its millisecond or a reply, see _ack_with_data) yet costs
        # ~0.1 ms of packet-builder Python before the handler's follow-up (the waiting
        # decode step) gets to run, and the follow-up takes several loop iterations. So
        # the transmit waits a millisecond, which is when aioquic's ACK timer fires
        # anyway: whatever the handler sends meanwhile goes out with its own transmit,
        # carrying anything else that was due (and cancels this one).
        if self._deferred_tx is None:
            self._deferred_tx = self._event_loop.call_later(DEFERRED_TRANSMIT_S, self.transmit)

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.HandshakeCompleted):
            self._on_handshake()
        elif isinstance(event, events.StreamDataReceived):
            self._on_stream_data(event)
        elif isinstance(event, events.ConnectionTerminated):
            reason = event.reason_phrase or f"connection closed (code {event.error_code})"
            if self.closed_reason is None:
                self.closed_reason = reason if event.error_code == 0 or event.reason_phrase else "idle timeout"
            self._notify_closed()

    def connection_lost(self, exc: Exception | None) -> None:  # transport gone
        if self._errors is not None:
            self._errors.close()
        if self.closed_reason is None:
            self.closed_reason = "transport closed"
        self._notify_closed()

    # ---- ICMP: the peer's port closed (meshnode.net.icmp) ------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.is_client:   # its own socket (a server-side link shares the listener's: net/quic.py)
            enlarge_socket_buffers(transport)
            self._errors = icmp.ErrorQueue(transport)

    def error_received(self, exc: Exception) -> None:
        # (asyncio: a read or write of the socket failed, here with a queued ICMP error)
        if self._errors is not None and self._errors.read():
            self.unreachable()

    def unreachable(self) -> None:
        """The kernel says a datagram to the peer's address was refused (ICMP port, host
        or network unreachable). Unauthenticated, so a hint: a heartbeat goes out now, and
        the peer is dropped only if nothing arrives from it within ``unreachable_s``."""
        if self.closed_reason is not None:
            return
        now = self._event_loop.time()
        actions = self.liveness.unreachable(now)
        if self.liveness.hinted_at == now:   # news (not a repeat of a pending hint)
            log.debug("peer %s at %s: unreachable says the kernel; waiting %.2f s for a sign of life",
                      self.peer_node_id, self.address, self.owner.settings.unreachable_s)
        self._act(actions, now)

    def _on_handshake(self) -> None:
        if event_alpn := getattr(self.quic.tls, "alpn_negotiated", None):
            if event_alpn != ALPN:
                return self.close_with(f"unexpected ALPN {event_alpn}")
        peer_cert = compat.peer_certificate(self.quic)
        if peer_cert is None:
            return self.close_with("peer presented no certificate")
        self.peer_node_id = node_id_of_cert(peer_cert)
        if self.peer_node_id == self.owner.identity.node_id:
            return self.close_with("connected to ourselves")
        self._size_datagrams()
        self._ack_space = compat.one_rtt_ack_space(self.quic)
        if self._ack_space is None:
            log.debug("aioquic's ACK state not found; replies go without their ACK")
        self.auth = self.owner.make_auth(
            self,
            is_client=self.is_client,
            nonce=os.urandom(NONCE_LEN),
            local_fp=self.owner.identity.fingerprint,
            peer_fp=cert_fingerprint(peer_cert),
            peer_node_id=self.peer_node_id,
        )
        if self.is_client:
            self.auth.start()
            self._flush_auth()

    def _ack_with_data(self) -> None:
        """Let the packet about to be sent carry the pending ACK.

        aioquic acknowledges a packet 1 ms after it arrived and only puts the ACK into
        packets sent after that millisecond: a reply sent sooner (the final stage's token,
        the next activation) left without it, and an ACK datagram of its own followed,
        waking the other process. A 2-stage decode showed ~0.7 such datagrams per token
        (UDP counters). Bulk flows keep aioquic's timer: acknowledging more often costs
        their sender ACK processing (`bench net` bulk at 1350 B: ~30% slower when every
        second datagram was acknowledged).
        """
        if self._ack_space is not None:
            compat.ack_with_next_packet(self._ack_space, self._event_loop.time())

    def _size_datagrams(self) -> None:
        """Send bigger datagrams to a peer on this host.

        QUIC must fit the path MTU (1350 B is safe on a LAN), but loopback's MTU is
        64 KiB: there a 16 KB datagram is never fragmented. Two nodes on one machine (the
        benchmarks, a workstation splitting a model across its own processes) then carry
        a decode step in one datagram, not two: on a 2-core VM the first
        of two datagrams took 0.53 ms to process before the second was read (aioquic's
        decrypt, frame parsing and an empty transmit), all on the critical path of the
        step. The handshake ran at the configured size; only 1-RTT packets grow.
        """
        size = self.owner.settings.loopback_datagram_size
        host = self.remote_addr[0] if self.remote_addr else ""
        if size > compat.max_datagram_size(self.quic) and _is_loopback(host):
            compat.set_max_datagram_size(self.quic, size)

    # ---- limits (see the module docstring) -------------------------------------------

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for this peer's streams: frames in progress in our decoders, plus
        what aioquic holds behind gaps (received, not yet delivered in order)."""
        return self._buffered + max(0, compat.received_stream_bytes(self.quic) - self._delivered)

    def _check_budget(self) -> None:
        """After every datagram: a peer that has not proved the secret may have sent at
        most ``handshake_max_bytes``; a member may hold at most ``peer_buffer_budget``."""
        if self.closed_reason is not None:
            return
        s = self.owner.settings
        if self.auth is None or not self.auth.peer_verified:
            sent = compat.received_stream_bytes(self.quic)
            if sent > s.handshake_max_bytes:
                self._refuse(f"{sent} bytes of stream data before authentication (at most {s.handshake_max_bytes})")
        elif (held := self.buffered_bytes) > s.peer_buffer_budget:
            log.warning("peer %s at %s holds %d bytes of unfinished frames (budget %d): closing the link",
                        self.peer_node_id, self.address, held, s.peer_buffer_budget)
            self.close_with(f"over the memory budget ({held} bytes buffered)")

    def _refuse(self, why: str) -> None:
        """Close an unauthenticated connection at once (nothing queued is worth sending)."""
        log.info("closing unauthenticated connection from %s (%s): %s", self.address,
                 self.peer_node_id or "no id yet", why)
        self.close_with(f"refused before authentication: {why}")

    # ---- streams ---------------------------------------------------------------------

    def _on_stream_data(self, event: events.StreamDataReceived) -> None:
        if self.closed_reason is not None:
            return
        self.liveness.received(self._event_loop.time())
        self.rx.total += len(event.data)
        self._delivered += len(event.data)
        sid = event.stream_id
        if not self.authenticated:
            return self._on_handshake_data(sid, event.data)
        dec = self._decoders.get(sid)
        if dec is None:
            dec = self._decoders[sid] = FrameDecoder()
        before = dec.buffered
        items = dec.feed(event.data)
        self._buffered += dec.buffered - before
        self._dispatch(sid, items)
        if event.end_stream and self._decoders.pop(sid, None) is not None:
            self._buffered -= dec.buffered
        if self._buffered > self.owner.settings.peer_buffer_budget:
            self._check_budget()

    def _dispatch(self, sid: int, items: list[Message | WireError]) -> None:
        for item in items:
            if self.closed_reason is not None:
                return
            if isinstance(item, WireError):
                self._on_wire_error(item)
            elif not self.authenticated:
                self._on_auth_message(sid, item)
            elif isinstance(item, Heartbeat):
                self._on_heartbeat(item)
            elif isinstance(item, LaneKey):
                self._on_lane_key(item)
            else:
                self.owner.link_message(self, item)

    def _on_handshake_data(self, sid: int, data: bytes) -> None:
        """Stream data before authentication: only the control stream (the client's first
        bidirectional stream, id 0), fed one frame at a time so that each frame is held
        to the cap of the handshake's progress at that frame (the peer's last handshake
        messages and its first messages as a member may share one chunk)."""
        control = 0 if not self.is_client else self._control_sid
        if self.auth is None or sid != control:
            return self._refuse(f"data on stream {sid} before authentication")
        self._control_sid = sid
        dec = self._decoders.get(sid)
        if dec is None:
            dec = self._decoders[sid] = FrameDecoder(max_frame=self.owner.settings.handshake_max_frame)
        mv, i = memoryview(data), 0
        while i < len(mv) and not self.authenticated:
            if self.closed_reason is not None or dec.state is not DecoderState.OPEN:
                return
            take = dec.wanted
            for item in dec.feed(mv[i : i + take]):
                if isinstance(item, WireError):
                    return self._refuse(f"bad handshake frame: {item.code.name} {item.detail[:80]}")
                self._on_auth_message(sid, item)
                if self.closed_reason is not None:
                    return
            i += take
            if self.auth.peer_verified and dec.max_frame < PROFILE_MAX_FRAME:
                dec.max_frame = PROFILE_MAX_FRAME   # a member: its Profile comes next
        if i < len(mv) and self.authenticated:   # the peer's first frames as a member
            before = dec.buffered
            items = dec.feed(mv[i:])
            self._buffered += dec.buffered - before
            self._dispatch(sid, items)

    def _on_wire_error(self, err: WireError) -> None:
        log.warning("peer %s sent a bad frame: %s %s", self.peer_node_id, err.code.name, err.detail)
        try:
            self.send(Error(ref=err.ref, code=err.code, message=err.detail[:200]))
        except ConnectionError:
            pass
        if err.fatal:
            self.close_with(f"protocol error: {err.code.name}", delay=0.05)

    def _on_auth_message(self, sid: int, msg: Message) -> None:
        if self.auth is None or sid != self._control_sid:
            return self._refuse("message before authentication")
        self.auth.receive(msg)
        self._flush_auth()

    def _flush_auth(self) -> None:
        assert self.auth is not None
        for out in self.auth.messages_to_send():
            self._send_on(self._control_stream(), encode(out))
        if self.auth.state is AuthState.AUTHENTICATED and not self.liveness.heartbeating:
            s = self.owner.settings
            control = self._decoders.get(self._control_sid) if self._control_sid is not None else None
            if control is not None:
                control.max_frame = MAX_FRAME
            compat.open_flow_control(self.quic, s.max_data)
            self.liveness.authenticated(self._event_loop.time())   # heartbeats from now on
            self._arm_watch()
            self.owner.link_authenticated(self)
            self._start_lane()
        elif self.auth.state is AuthState.FAILED and self.closed_reason is None:
            self.closed_reason = f"authentication failed: {self.auth.reason}"
            self._release_buffers()
            try:
                who = "peer refused us" if self.auth.refused_by_peer else "refused peer"
                log.warning("%s %s at %s: %s", who, self.peer_node_id, self.address, self.auth.reason)
            finally:   # whatever the log line does, the connection goes
                self._close_later(0.1)

    # ---- the fast lane (meshnode.net.lane) ------------------------------------------

    def send_lane(self, msg: Message) -> bool:
        """Send ``msg`` (a message or an encoded frame) as one lane packet; False, sending
        nothing, when the lane is not ready (the caller uses :meth:`send_data`). The
        lane is lossy: the caller must notice a lost frame (see :meth:`lane_missed`)."""
        if not self.lane_ready or self.closed_reason is not None:
            return False
        frame = msg if isinstance(msg, (bytes, bytearray, memoryview)) else encode(msg)
        if len(frame) > LANE_MAX_FRAME:
            return False
        if timeline.RECORDER is not None:   # the frame is ready: sealing and the sendto follow
            timeline.RECORDER.mark("send<")
        self._lane_send(frame)
        if timeline.RECORDER is not None:
            timeline.RECORDER.mark("send>")
        return True

    def lane_missed(self) -> None:
        """A frame sent on the lane got no answer in time. A second one soon after switches
        the lane off (a lossy path, a firewall that drops it, a path that changed:
        net/lane_control.py); it is probed again
        after ``lane_backoff_s``, doubling with every switch-off (a lane that keeps
        failing, e.g. in one direction only, must not keep costing resends)."""
        wait = self.lane.missed(self._event_loop.time())
        if wait is not None:
            log.warning("fast lane to %s lost 2 frames within %d: using QUIC streams, probing "
                        "it again in %.0f s", self.peer_node_id, LANE_LOSS_WINDOW, wait)

    def lane_received(self, packet: bytes) -> None:
        """A lane packet sealed with our key (the owner found us by its key id)."""
        if self.lane_rx is None or self.closed_reason is not None:
            return
        if timeline.RECORDER is not None:
            timeline.RECORDER.mark("recv<")
        try:
            plain = self.lane_rx.open(packet)
            frame = plain[:HEADER_SIZE + parse_header(plain)[1]] if len(plain) >= HEADER_SIZE else plain
            msg = decode(frame)
        except LaneDrop as exc:
            log.debug("lane packet from %s dropped: %s", self.peer_node_id, exc)
            return
        except RemoteProtocolError as exc:
            log.warning("peer %s sent a bad frame on the lane: %s", self.peer_node_id, exc)
            return
        if not isinstance(msg, _LANE_KINDS):
            log.warning("peer %s sent %s on the lane (only per-token frames go there): dropped",
                        self.peer_node_id, type(msg).__name__)
            return
        self.liveness.received(self._event_loop.time())
        self.rx.total += len(frame)
        if isinstance(msg, Heartbeat):
            if not msg.echo:
                self._lane_heartbeat(msg.seq, msg.sent_ns, echo=True)
            elif self.lane.echo_received(msg.seq):
                log.debug("fast lane to %s ready (%.2f ms round trip)", self.peer_node_id,
                          (time.monotonic_ns() - msg.sent_ns) / 1e6)
            return
        self.lane.frame_received()
        if timeline.RECORDER is not None:   # (before the hand-off: a stage may compute inside it)
            timeline.RECORDER.mark("recv>")
        self.owner.link_message(self, msg)

    def _start_lane(self) -> None:
        if not self.owner.settings.lane or self.closed_reason is not None or self.lane_rx is not None:
            return
        self.lane_rx = self.owner.lane_receiver(self)
        self.send(LaneKey(ref=0, key_id=self.lane_rx.key_id, key=self.lane_rx.key))

    def _on_lane_key(self, msg: LaneKey) -> None:
        if not self.owner.settings.lane:
            return   # never sent ours either: the peer never gets a probe back
        self._lane_tx = LaneSender(msg.key_id, msg.key)
        self._send_probe(self.lane.key_received(self._event_loop.time()))

    def _send_probe(self, seq: int | None) -> None:
        if seq is not None:
            self._lane_heartbeat(seq, time.monotonic_ns(), echo=False)

    def _lane_heartbeat(self, seq: int, sent_ns: int, *, echo: bool) -> None:
        """A probe, or its echo, padded to the largest frame the lane will carry."""
        self._lane_send(encode(Heartbeat(ref=0, seq=seq, sent_ns=sent_ns, echo=echo)), pad_to=LANE_MAX_FRAME)

    def _lane_send(self, frame: bytes | bytearray | memoryview, pad_to: int = 0) -> None:
        transport = compat.datagram_transport(self)
        # only to an address QUIC validated: a datagram's source is whatever its sender
        # wrote, so a spoofed one must not redirect the lane
        addr = compat.validated_peer_address(self.quic)
        if self._lane_tx is None or addr is None or transport is None:
            return
        transport.sendto(self._lane_tx.seal(frame, pad_to=pad_to), addr)
        self.tx.total += len(frame)

    # ---- keep-alive (meshnode.net.liveness) ---------------------------------------

    def _on_heartbeat(self, hb: Heartbeat) -> None:
        if hb.echo:
            self.rtt_ms = (time.monotonic_ns() - hb.sent_ns) / 1e6
        else:
            self.send(Heartbeat(ref=hb.ref, seq=hb.seq, sent_ns=hb.sent_ns, echo=True))

    def _arm_watch(self) -> None:
        """(Re-)arm the one timer of :attr:`liveness` for the time it asks for."""
        at = self.liveness.next_timer()
        if at == self._watch_at:
            return
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self._watch_at = at
        if at is not None:
            self._watch = self._event_loop.call_at(at, self._on_watch)

    def _on_watch(self) -> None:
        # like aioquic's timer: never earlier than asked for, even if the loop woke early
        now = max(self._watch_at or 0.0, self._event_loop.time())
        self._watch = self._watch_at = None
        if self.closed_reason is not None:   # closing: no heartbeat, no deadline
            self.liveness.stop()
            return
        record = max(self.liveness.max_silent_s, self.liveness.heartbeat_s)   # log records above one period
        actions = self.liveness.handle_timer(now)
        if self.liveness.max_silent_s > record:   # how close a live link came to being dropped
            log.debug("peer %s: longest silence so far %.3f s (dropped after %.1f s)",
                      self.peer_node_id, self.liveness.max_silent_s, self.liveness.dead_after_s)
        self._act(actions, now)

    def _act(self, actions: list[LivenessAction], now: float) -> None:
        """Carry out what :attr:`liveness` asked for, then re-arm its timer."""
        for action in actions:
            if isinstance(action, SendHeartbeat):
                try:
                    self.send(Heartbeat(ref=0, seq=action.seq, sent_ns=time.monotonic_ns(), echo=False))
                except ConnectionError:
                    self.liveness.stop()
                    return
                self._send_probe(self.lane.heartbeat(now))   # the lane is probed at heartbeat pace
                self.rx.tick(now)
                self.tx.tick(now)
            elif isinstance(action, PeerSilent):
                log.info("peer %s silent for %.1f s: dropping it", self.peer_node_id, action.silent_s)
                self.close_with("peer vanished (no heartbeat)")
                self._notify_closed()
                return
            elif isinstance(action, PeerUnreachable):
                if not self.authenticated:
                    log.debug("%s %s: port unreachable", "dial to" if self.is_client else "link from", self.address)
                    self.close_with("port unreachable")
                    return
                log.info("peer %s unreachable and silent for %.2f s: dropping it", self.peer_node_id,
                         action.waited_s)
                self.close_with("peer vanished (port unreachable)")
                self._notify_closed()
                return
            elif isinstance(action, AuthTimedOut):
                try:
                    if self.is_client and self.auth is None:
                        # our dial got no QUIC handshake back: an address nobody answers
                        # on any more (a member that restarted on another port, a laptop
                        # gone); the dialler says so and backs off
                        log.debug("dial to %s: no answer within the authentication deadline", self.address)
                    else:
                        log.warning("peer %s at %s: authentication timed out", self.peer_node_id, self.address)
                finally:   # the deadline holds even if the log line raised
                    self.close_with("authentication timed out")
                return
        self._arm_watch()

    def _notify_closed(self) -> None:
        if self._notified_closed:
            return
        self._notified_closed = True
        self._release_buffers()
        self.lane.closed()
        self.liveness.stop()
        self._arm_watch()   # cancels it
        self.owner.link_closed(self, self.closed_reason or "closed")
        compat.mark_closed(self)


LinkFactory = Callable[..., PeerLink]
