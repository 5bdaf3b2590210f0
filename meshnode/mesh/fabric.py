"""The node's mesh fabric: discovery + authenticated QUIC links + message routing.

Theory of operation: the fabric advertises this node over mDNS
(:mod:`meshnode.net.discovery`), listens for QUIC links and dials peers of the same mesh
(:mod:`meshnode.net.quic`; each connection is a :class:`~meshnode.net.link.PeerLink`), but
never touches QUIC itself. A peer is *a member* only while an authenticated link to it
is up; mDNS records are hints (a killed process leaves its record in caches).

What mDNS may and may not do (anyone on the LAN can announce records under our public
mesh id): a record names a node id and where it may be dialled, nothing more.

* Capabilities come from the authenticated link only: the peer's Hello, then its
  ``CapsUpdate`` messages. Record contents never reach :meth:`MeshFabric.peers`.
* A dial made for a record expects that record's node id: a peer whose certificate
  (hence node id, :mod:`meshnode.net.identity`) differs is dropped.
* A known member is redialled first at the address its last authenticated link used;
  announcements add candidate addresses behind it, they never redirect it.

One connection per peer pair: for a discovered peer, the node with the lower node id
dials at once, the other only after a grace period (asymmetric discovery). When two
authenticated links to the same peer exist anyway, both ends keep the one dialled by
the lower node id and close the other; that rule needs no coordination.

Requests: :meth:`MeshFabric.request` gives the message a fresh ``ref`` when it has
``ref == 0`` and resolves with the first message from that peer carrying the same ref
(on any stream). Everything else goes to the ``on_message`` callbacks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import socket
from collections.abc import Callable, Hashable
from typing import Any

from meshnode import PROTOCOL_VERSION
from meshnode.errors import MeshnodeError, cannot_listen
from meshnode.mesh.fabric_api import MessageCallback, PeerChangeCallback
from meshnode.mesh.local_caps import local_capabilities
from meshnode.net import caps as capsmod
from meshnode.net.auth import AuthHandshake, check_capabilities
from meshnode.net.discovery import DiscoveredPeer, Discovery
from meshnode.net.identity import Identity
from meshnode.net.lane import LaneReceiver, lane_key_id
from meshnode.net.link import LinkSettings, PeerLink
from meshnode.net.quic import QuicListener, dial, listen
from meshnode.net.secret import SecretStore, SecretStoreError, mesh_id
from meshnode.paths import NodePaths
from meshnode.state import PeerInfo, printable
from meshnode.wire import CapsUpdate, Error, ErrorCode, Hello, Message, SecretAck, SecretRotate

log = logging.getLogger(__name__)


DIAL_GRACE_S = 1.0      # the higher node id waits this long for the lower one to dial
RETRY_MIN_S = 0.5
RETRY_MAX_S = 5.0
ANY_NODE = "*"              # a dial that accepts whichever node answers (static peers)


class PeerUnavailableError(MeshnodeError):
    """No authenticated link to that peer."""


class PeerReplyError(MeshnodeError):
    """The peer answered a request with ``Error``; ``.error`` holds it."""

    def __init__(self, error: Error) -> None:
        super().__init__(f"peer error {error.code.name}: {error.message}")
        self.error = error


class MeshFabric:
    """Peers, links and messages of one node. See the module docstring.

    ``identity``/``secret`` default to the ones stored under ``paths`` (created on first
    use). ``port`` is the UDP port of the QUIC server (0 = any). ``interfaces``: IPv4
    addresses for mDNS (None = all). ``static_peers``: ``"host:port"`` endpoints to dial
    without discovery. ``discovery=False`` turns mDNS off (benchmarks, static setups).
    """

    def __init__(
        self,
        paths: NodePaths,
        identity: Identity | None = None,
        secret: bytes | None = None,
        port: int = 0,
        interfaces: list[str] | None = None,
        *,
        name: str | None = None,
        capabilities: dict[str, Any] | None = None,
        static_peers: list[str] | tuple[str, ...] = (),
        discovery: bool = True,
        settings: LinkSettings | None = None,
        bind_host: str = "0.0.0.0",
    ) -> None:
        self.paths = paths
        self.identity = identity or Identity.load_or_create(paths.identity)
        self.secret = secret if secret is not None else SecretStore(paths).load_or_create()
        self.mesh_id = mesh_id(self.secret)
        self.node_id = self.identity.node_id
        self.name = name or socket.gethostname()
        self._announced_name = name or ""   # mDNS carries a name only when the user chose one
        self.settings = settings or LinkSettings()
        self._port = port
        self._bind_host = bind_host
        self._interfaces = interfaces
        self._caps: dict[str, Any] = capabilities if capabilities is not None else capsmod.to_dict(local_capabilities())
        self._static = [_parse_hostport(p) for p in static_peers]
        self._static_ids: dict[str, str] = {}  # "host:port" -> node id seen there
        self._use_discovery = discovery
        self._discovery: Discovery | None = None
        self._server: QuicListener | None = None
        self._links: dict[str, PeerLink] = {}        # node id -> the authenticated link in use
        self._lane_links: dict[int, PeerLink] = {}   # lane key id -> the link it belongs to
        self._all_links: set[PeerLink] = set()
        self._records: dict[str, DiscoveredPeer] = {}      # mDNS service name -> record (a hint)
        self._known: dict[str, tuple[str, int]] = {}       # node id -> address of its last authenticated link
        self._peer_caps: dict[str, dict[str, Any]] = {}    # node id -> capabilities its link sent
        self._expect: dict[tuple[str, int], list[str]] = {}  # dial address -> node ids its dials expect
        self._dialing: dict[str, asyncio.Task] = {}  # node id or "host:port" -> dial task
        self._pending: dict[tuple[str, int], asyncio.Future] = {}
        self._msg_cbs: list[MessageCallback] = []
        self._peer_cbs: list[PeerChangeCallback] = []
        self._tasks: set[asyncio.Task] = set()
        self._running = False

    # ---- lifecycle -------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound QUIC (UDP) port, valid after :meth:`start`."""
        return self._port

    async def start(self) -> None:
        """Start the QUIC server, advertise over mDNS, dial static peers."""
        self._running = True
        try:
            self._server = await listen(self, self._bind_host, self._port)
        except OSError as exc:
            self._running = False
            raise cannot_listen(f"listen for peers on UDP {self._bind_host or '*'}:{self._port}", exc,
                                "--quic-port") from None
        self._port = self._server.port
        log.info("node %s (%s) in mesh %s: QUIC on port %d", self.node_id, self.name, self.mesh_id, self._port)
        if self._use_discovery:
            await self._start_discovery()
        for host, port in self._static:
            self._ensure_dial(f"{host}:{port}", host, port, delay=0.0, persistent=True)

    async def _start_discovery(self) -> None:
        self._discovery = Discovery(
            node_id=self.node_id, mesh_id=self.mesh_id, name=self._announced_name, port=self._port,
            protocol=PROTOCOL_VERSION, interfaces=self._interfaces,
            on_found=self._on_found, on_lost=self._on_lost,
        )
        await self._discovery.start()

    async def stop(self) -> None:
        """Withdraw the mDNS record, close every link and the server (idempotent)."""
        if not self._running:
            return
        self._running = False
        if self._discovery is not None:
            await self._discovery.stop()
        for t in list(self._dialing.values()) + list(self._tasks):
            t.cancel()
        for link in list(self._all_links):
            if link.closed_reason is None:
                link.close_with("node stopping")
        await asyncio.sleep(0.05)  # let CONNECTION_CLOSE frames leave
        if self._server is not None:
            self._server.close()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(PeerUnavailableError("fabric stopped"))

    # ---- public API ------------------------------------------------------------

    def peers(self) -> list[PeerInfo]:
        """Peers with an authenticated link, sorted by name."""
        out = []
        for node_id, link in self._links.items():
            peer = link.auth.peer if link.auth else None
            caps = capsmod.from_dict(self._peer_caps.get(node_id))
            if caps is not None:   # names from another machine reach terminals: no control characters
                caps = dataclasses.replace(caps, models=tuple(
                    dataclasses.replace(m, name=printable(m.name, 100), sha256=printable(m.sha256, 64))
                    for m in caps.models))
            out.append(PeerInfo(
                node_id=node_id,
                name=printable(peer.name, 64) if peer else "",
                address=link.address,
                rtt_ms=round(link.rtt_ms, 3) if link.rtt_ms is not None else None,
                authenticated=link.authenticated,
                capabilities=caps,
                bytes_per_s_in=link.rx.rate,
                bytes_per_s_out=link.tx.rate,
                lane=link.lane_ready,
            ))
        return sorted(out, key=lambda p: (p.name, p.node_id))

    def on_message(self, callback: MessageCallback) -> None:
        """Call ``callback(node_id, msg)`` (sync or async) for each received message
        that is not a reply to one of our requests (control and data streams)."""
        self._msg_cbs.append(callback)

    def on_peer_change(self, callback: PeerChangeCallback) -> None:
        """Call ``callback(node_id, peer_info_or_None, reason)`` when a peer joins
        (PeerInfo) or leaves (None, with a reason)."""
        self._peer_cbs.append(callback)

    def next_ref(self, node_id: str) -> int:
        return self._link(node_id).next_ref()

    async def send(self, node_id: str, msg: Message) -> None:
        """Queue ``msg`` on the control stream to ``node_id``.

        Raises :class:`PeerUnavailableError` when there is no authenticated link."""
        link = self._link(node_id)
        try:
            link.send(msg)
        except ConnectionError as exc:
            raise PeerUnavailableError(f"peer {node_id}: {exc}") from exc

    def send_lane(self, node_id: str, msg: Message) -> bool:
        """Send ``msg`` to ``node_id`` on the fast lane (meshnode.net.lane): lossy, for
        per-token frames whose loss the caller notices. False, sending nothing, when
        there is no ready lane to that peer: use :meth:`send_data` then."""
        link = self._links.get(node_id)
        return link is not None and link.send_lane(msg)

    def lane_ready(self, node_id: str) -> bool:
        """True when frames to ``node_id`` can go on the fast lane now."""
        link = self._links.get(node_id)
        return link is not None and link.lane_ready

    def lane_missed(self, node_id: str) -> None:
        """A frame sent to ``node_id`` on the lane went unanswered (see PeerLink.lane_missed)."""
        link = self._links.get(node_id)
        if link is not None:
            link.lane_missed()

    async def send_data(self, node_id: str, msg: Message, stream_key: Hashable) -> None:
        """Queue ``msg`` on the data stream ``stream_key`` to ``node_id`` (one QUIC
        stream per (peer, key): ordered within a key, independent of control)."""
        self.send_data_now(node_id, msg, stream_key)

    def send_data_now(self, node_id: str, msg: Message, stream_key: Hashable) -> None:
        """:meth:`send_data` for callers that cannot await (timer callbacks)."""
        link = self._link(node_id)
        try:
            link.send_data(msg, stream_key)
        except ConnectionError as exc:
            raise PeerUnavailableError(f"peer {node_id}: {exc}") from exc

    def close_data_stream(self, node_id: str, stream_key: Hashable) -> None:
        link = self._links.get(node_id)
        if link is not None:
            link.close_data_stream(stream_key)

    async def request(self, node_id: str, msg: Message, timeout: float = 5.0, *,
                      data_stream: Hashable | None = None) -> Message:
        """Send ``msg`` and wait for the reply with the same ref.

        A ``msg.ref`` of 0 is replaced by a fresh ref. Returns the reply message; raises
        :class:`PeerReplyError` when the reply is ``Error``, ``asyncio.TimeoutError``
        after ``timeout`` s and :class:`PeerUnavailableError` when the link is (or goes)
        down. ``data_stream``: send on that data stream instead of control.
        """
        link = self._link(node_id)
        if msg.ref == 0:
            msg = dataclasses.replace(msg, ref=link.next_ref())
        key = (node_id, msg.ref)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[key] = fut
        try:
            if data_stream is None:
                await self.send(node_id, msg)
            else:
                await self.send_data(node_id, msg, data_stream)
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(key, None)
        if isinstance(reply, Error):
            raise PeerReplyError(reply)
        return reply

    async def set_capabilities(self, capabilities: dict[str, Any] | Any) -> None:
        """Replace this node's capability summary and send it to every member
        (``CapsUpdate`` on each authenticated link; mDNS carries no capabilities).
        Accepts the dict form (:mod:`meshnode.net.caps`) or a ``Capabilities``."""
        if not isinstance(capabilities, dict):
            capabilities = capsmod.to_dict(capabilities)
        if capabilities == self._caps:
            return
        self._caps = capabilities
        update = CapsUpdate(ref=0, capabilities={**capabilities, "quic_port": self._port})
        for link in list(self._links.values()):
            try:
                link.send(update)
            except ConnectionError:
                pass   # the link is going: the peer gets our Hello when it comes back

    async def use_secret(self, secret: bytes) -> None:
        """Use ``secret`` from now on (``meshnode mesh rotate``): new links prove it, the
        mDNS record names its mesh id. Links already up stay up."""
        self.secret, self.mesh_id = secret, mesh_id(secret)
        log.warning("mesh secret replaced: this node is now in mesh %s", self.mesh_id)
        if self._discovery is not None:
            await self._discovery.stop()
            self._records.clear()
            await self._start_discovery()

    @property
    def capabilities(self) -> dict[str, Any]:
        return dict(self._caps)

    # ---- LinkOwner callbacks -------------------------------------------------------

    def make_hello(self) -> Hello:
        return Hello(
            ref=0, node_id=self.node_id, name=self.name, mesh_id=self.mesh_id,
            protocol=PROTOCOL_VERSION, capabilities={**self._caps, "quic_port": self._port},
        )

    def make_auth(self, link: PeerLink, **kwargs: Any) -> AuthHandshake:
        return AuthHandshake(secret=self.secret, hello=self.make_hello(), protocol=PROTOCOL_VERSION, **kwargs)

    def link_created(self, link: PeerLink) -> None:
        self._all_links.add(link)

    def link_authenticated(self, link: PeerLink) -> None:
        node_id = link.peer_node_id
        assert node_id is not None
        if link.is_client and link.remote_addr is not None:
            expected = self._expect.get((link.remote_addr[0], link.remote_addr[1]))
            if expected is not None and node_id not in expected and ANY_NODE not in expected:
                log.warning("dialled %s:%d for %s but node %s answered: dropped", link.remote_addr[0],
                            link.remote_addr[1], "/".join(sorted(expected)), node_id)
                link.close_with("not the announced node")
                return
        old = self._links.get(node_id)
        if old is not None and old is not link and old.closed_reason is None:
            # Duplicate: keep the link dialled by the lower node id.
            keep_new = link.is_client == (self.node_id < node_id)
            loser = old if keep_new else link
            if not keep_new:
                log.debug("duplicate link to %s: keeping the existing one", node_id)
                loser.close_with("duplicate connection")
                return
            log.debug("duplicate link to %s: replacing the existing one", node_id)
            self._links[node_id] = link
            self._learn(link, node_id)
            old.close_with("duplicate connection")
            return
        self._links[node_id] = link
        self._learn(link, node_id)
        info = next((p for p in self.peers() if p.node_id == node_id), None)
        log.info("peer %s (%s) at %s authenticated", node_id, info.name if info else "?", link.address)
        self._emit_peer(node_id, info, "authenticated")

    def _learn(self, link: PeerLink, node_id: str) -> None:
        """What an authenticated link tells about its peer: its capabilities (Hello) and
        the address to redial it at (where we dialled it, or its source address with the
        QUIC port its Hello names)."""
        peer = link.auth.peer if link.auth else None
        self._peer_caps[node_id] = _checked_caps(peer.capabilities if peer else None, node_id) or {}
        if link.remote_addr is None:
            return
        host, port = link.remote_addr[0], link.remote_addr[1]
        if not link.is_client:
            port = _port_of(peer.capabilities if peer else None) or 0
        if port:
            self._known[node_id] = (host, port)

    def link_message(self, link: PeerLink, msg: Message) -> None:
        node_id = link.peer_node_id or ""
        if isinstance(msg, (CapsUpdate, SecretRotate)):
            if self._links.get(node_id) is link:   # only the link in use speaks for its peer
                if isinstance(msg, CapsUpdate):
                    caps = _checked_caps(msg.capabilities, node_id)
                    if caps is not None:
                        self._peer_caps[node_id] = caps
                else:
                    self._spawn(self._rotate_requested(link, node_id, msg))
            return
        fut = self._pending.get((node_id, msg.ref)) if msg.ref else None
        if fut is not None and not fut.done():
            fut.set_result(msg)
            return
        for cb in self._msg_cbs:
            self._call(cb, node_id, msg)

    def lane_receiver(self, link: PeerLink) -> LaneReceiver:
        rx = LaneReceiver()
        while rx.key_id in self._lane_links:   # 32 random bits: a clash is rare, not impossible
            rx = LaneReceiver()
        self._lane_links[rx.key_id] = link
        return rx

    def lane_datagram(self, data: bytes, addr: Any) -> None:
        """A lane packet on one of our sockets: hand it to the link whose key it names."""
        link = self._lane_links.get(lane_key_id(data) or 0)
        if link is None:
            log.debug("lane packet from %s with an unknown key: dropped", addr)
            return
        link.lane_received(data)

    async def _rotate_requested(self, link: PeerLink, node_id: str, msg: SecretRotate) -> None:
        """A member replaces the mesh secret (``meshnode mesh rotate``): store it, read it
        back, then use it; answer SecretAck, or Error when it could not be stored."""
        log.warning("member %s replaces the mesh secret", node_id)
        try:
            where = await asyncio.to_thread(SecretStore(self.paths).save, msg.secret)
        except (SecretStoreError, OSError) as exc:
            log.error("could not store the new mesh secret: %s", exc)
            reply: Message = Error(ref=msg.ref, code=ErrorCode.INTERNAL, message=f"cannot store the secret: {exc}"[:200])
        else:
            log.info("new mesh secret stored in %s", where)
            await self.use_secret(msg.secret)
            reply = SecretAck(ref=msg.ref, mesh_id=self.mesh_id)
        try:
            link.send(reply)
        except ConnectionError:
            pass

    def link_closed(self, link: PeerLink, reason: str) -> None:
        self._all_links.discard(link)
        if link.lane_rx is not None:
            self._lane_links.pop(link.lane_rx.key_id, None)
        node_id = link.peer_node_id
        if node_id is None or self._links.get(node_id) is not link:
            return
        del self._links[node_id]
        self._peer_caps.pop(node_id, None)
        log.info("peer %s lost: %s", node_id, reason)
        for key, fut in list(self._pending.items()):
            if key[0] == node_id and not fut.done():
                fut.set_exception(PeerUnavailableError(f"peer {node_id} lost: {reason}"))
        self._emit_peer(node_id, None, reason)
        if self._running and self._has_record(node_id) and reason != "node stopping":
            self._ensure_dial(node_id, delay=RETRY_MIN_S)

    # ---- discovery and dialing ---------------------------------------------------------

    def _on_found(self, peer: DiscoveredPeer) -> None:
        self._records[peer.service or peer.node_id] = peer
        if peer.node_id in self._links:
            return   # a member: the record may add a candidate address, it changes nothing now
        delay = 0.0 if self.node_id < peer.node_id else DIAL_GRACE_S
        self._ensure_dial(peer.node_id, delay=delay)

    def _on_lost(self, service: str) -> None:
        peer = self._records.pop(service, None)
        if peer is None or self._has_record(peer.node_id):
            return
        task = self._dialing.pop(peer.node_id, None)
        if task is not None:
            task.cancel()

    def _has_record(self, node_id: str) -> bool:
        return any(r.node_id == node_id for r in self._records.values())

    def _dial_targets(self, node_id: str) -> list[tuple[str, int]]:
        """Where to dial ``node_id``: the address its last authenticated link used, then
        the addresses its records announce (each dial checks the node id it finds)."""
        out = [self._known[node_id]] if node_id in self._known else []
        for rec in list(self._records.values()):
            if rec.node_id == node_id:
                out += [(a, rec.port) for a in rec.addresses if (a, rec.port) not in out]
        return out

    def _ensure_dial(self, key: str, host: str = "", port: int = 0, *, delay: float, persistent: bool = False) -> None:
        if not self._running or (key in self._dialing and not self._dialing[key].done()):
            return
        task = asyncio.get_running_loop().create_task(self._dial_loop(key, host, port, delay, persistent))
        self._dialing[key] = task

    async def _dial_loop(self, key: str, host: str, port: int, delay: float, persistent: bool) -> None:
        backoff = RETRY_MIN_S
        await asyncio.sleep(delay)
        while self._running:
            if persistent:
                if self._static_ids.get(key) in self._links:
                    await asyncio.sleep(RETRY_MIN_S)  # already linked (the peer dialled us)
                    continue
                targets = [(host, port)]
            else:
                targets = self._dial_targets(key)
                if key in self._links or not targets:
                    return
            for host, port in targets:
                if not persistent and key in self._links:
                    return
                reason = await self._dial_once(host, port, static_key=key if persistent else None,
                                               expect=ANY_NODE if persistent else key)
                log.debug("dial %s:%d ended: %s", host, port, reason)
            if not persistent and key in self._links:
                return
            log.debug("dialling %s again in %.1f s", key, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RETRY_MAX_S)

    async def _dial_once(self, host: str, port: int, static_key: str | None = None, expect: str = ANY_NODE) -> str:
        """Dial, and hold the connection until it closes; returns why it ended.
        ``expect``: the node id the dial is for; another node answering is dropped."""
        addr = (host, port)
        self._expect.setdefault(addr, []).append(expect)
        try:
            async with dial(self, host, port) as link:
                if expect != ANY_NODE and link.peer_node_id != expect:
                    log.warning("dialled %s:%d for node %s but node %s answered: dropped",
                                host, port, expect, link.peer_node_id)
                    link.close_with("not the announced node")
                    return "not the announced node"
                if static_key is not None and link.peer_node_id:
                    self._static_ids[static_key] = link.peer_node_id
                await link.wait_closed()
                return link.closed_reason or "closed"
        except (ConnectionError, OSError) as exc:
            return f"connect failed: {str(exc) or type(exc).__name__}"
        finally:
            waiting = self._expect.get(addr, [])
            if expect in waiting:
                waiting.remove(expect)
            if not waiting:
                self._expect.pop(addr, None)

    # ---- helpers -------------------------------------------------------------------------

    def _link(self, node_id: str) -> PeerLink:
        link = self._links.get(node_id)
        if link is None or not link.authenticated:
            raise PeerUnavailableError(f"no authenticated link to peer {node_id}")
        return link

    def _emit_peer(self, node_id: str, info: PeerInfo | None, reason: str) -> None:
        for cb in self._peer_cbs:
            self._call(cb, node_id, info, reason)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _call(self, cb: Callable[..., Any], *args: Any) -> None:
        try:
            res = cb(*args)
        except Exception:
            log.exception("callback %r failed", cb)
            return
        if inspect.isawaitable(res):
            task = asyncio.ensure_future(res)
            self._tasks.add(task)
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("callback failed", exc_info=task.exception())


def _parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise MeshnodeError(f"bad peer address {text!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def _port_of(caps: dict[str, Any] | None) -> int | None:
    port = caps.get("quic_port") if isinstance(caps, dict) else None
    return port if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 else None


def _checked_caps(caps: Any, node_id: str) -> dict[str, Any] | None:
    """A peer's capability summary when it is one we can use, else None (logged): the
    same checks as the Profile at authentication (:func:`meshnode.net.auth.check_capabilities`:
    types, ranges, bounded size), so a ``CapsUpdate`` cannot carry what a Profile may not."""
    why = check_capabilities(caps)
    if why is None and capsmod.from_dict(caps) is None:
        why = "unreadable"
    if why is not None:
        log.warning("peer %s sent capabilities this node cannot use (%s): ignored", node_id, why)
        return None
    return caps
