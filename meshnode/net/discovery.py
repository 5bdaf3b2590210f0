"""mDNS discovery of peers (zeroconf, asyncio API).

Each node registers ``<node_id>._meshnode._udp.local.`` with its QUIC port in the SRV
record and a TXT record holding: ``id`` (node id), ``mesh`` (mesh id: a hash, never
the secret), ``proto`` (protocol version) and ``name`` only when the user named the
node (``--name``): never the hostname. :meth:`Discovery.stop` withdraws the record
(goodbye packets), so peers stop dialling it.

mDNS is unauthenticated: anybody on the LAN can announce any record under our (public)
mesh id. So a record is only an *address hint*: it says where a node id may be dialled,
nothing else. Capabilities travel only over authenticated links (Hello, then
``CapsUpdate``), the dialled certificate must carry the announced node id, and a known
member is redialled at the address its authenticated link used
(:mod:`meshnode.mesh.fabric`). Records of other meshes, of other protocol versions and
our own are ignored.

Announce little: the record is multicast to everyone on the link and a laptop carries
it from network to network. It holds no capabilities (models, RAM), no hostname unless
the user chose a name, and only the addresses of the interface meshnode uses (the one
of the default route, or the LAN interfaces), never VPN or container bridges.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

import ifaddr
from zeroconf import IPVersion, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger(__name__)

SERVICE_TYPE = "_meshnode._udp.local."
MAX_NAME = 64            # characters of a node name in the record (and kept from one)
MAX_ADDRESSES = 4        # addresses taken from one record
MAX_RECORDS = 64         # records of our mesh kept at once (a forger can announce thousands)
GOODBYE_WAIT_S = 1.0     # bound on sending the goodbyes at stop (they take ~0.25 s)
# Interfaces that are not the LAN: container bridges, VMs, VPNs and overlay networks.
# Announcing their addresses tells strangers about them and gives peers dead ends to dial.
VIRTUAL_PREFIXES = ("docker", "br-", "veth", "virbr", "vboxnet", "vmnet", "lxc", "lxd", "cni",
                    "flannel", "cali", "podman", "tun", "tap", "wg", "tailscale", "zt", "utun",
                    "ipsec", "ppp", "vpn", "nordlynx", "proton")


@dataclass(frozen=True, slots=True)
class DiscoveredPeer:
    """One mDNS record of our mesh: where ``node_id`` says it can be dialled (a hint)."""

    node_id: str
    name: str
    mesh_id: str
    protocol: int
    addresses: tuple[str, ...]
    port: int
    service: str = ""    # the mDNS service name the record came under


def encode_txt(node_id: str, mesh_id: str, protocol: int, name: str = "") -> dict[str, str]:
    """TXT properties of our record; ``name`` only when the user named the node."""
    props = {"id": node_id, "mesh": mesh_id, "proto": str(protocol)}
    if name:
        props["name"] = name[:MAX_NAME]
    return props


def decode_txt(props: dict[bytes, bytes | None]) -> dict[str, object] | None:
    """``{"id", "mesh", "proto", "name"}`` of a record, or None when malformed. Anything
    else a record carries (old records had capabilities) is ignored."""
    p = {k.decode("utf-8", "replace"): (v or b"").decode("utf-8", "replace") for k, v in props.items()}
    try:
        node_id, mesh = p["id"], p["mesh"]
        proto = int(p["proto"])
    except (KeyError, ValueError):
        return None
    if not (0 < len(node_id) <= 64 and 0 < len(mesh) <= 64):
        return None
    return {"id": node_id, "mesh": mesh, "proto": proto, "name": p.get("name", "")[:MAX_NAME]}


def advertised_addresses(interfaces: list[str] | None) -> list[str]:
    """IPv4 addresses to put in our record (and to run mDNS on).

    The addresses the user chose (``--interface``) as given; else the LAN addresses: no
    loopback, link-local or virtual interface (:data:`VIRTUAL_PREFIXES`), and of those
    the default route's address alone when it is one of them."""
    if interfaces:
        return [a for a in interfaces if _is_ipv4(a)] or ["127.0.0.1"]
    lan: list[str] = []
    for adapter in ifaddr.get_adapters():
        name = str(adapter.nice_name or adapter.name).lower()
        if name == "lo" or name.startswith(VIRTUAL_PREFIXES):
            continue
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and _is_ipv4(ip.ip):
                addr = ipaddress.IPv4Address(ip.ip)
                if not (addr.is_loopback or addr.is_link_local or addr.is_unspecified):
                    lan.append(ip.ip)
    default = _default_route_address()
    if default in lan:
        return [default]
    return lan or ["127.0.0.1"]


def _default_route_address() -> str | None:
    """The source address of the default route (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))   # TEST-NET-1: routed by the default route, never reached
            return str(s.getsockname()[0])
    except OSError:
        return None


def _is_ipv4(a: str) -> bool:
    try:
        socket.inet_aton(a)
        return a.count(".") == 3
    except OSError:
        return False


class Discovery:
    """Advertise this node and browse for peers of the same mesh.

    ``on_found(peer)`` is called for new and updated records of our mesh,
    ``on_lost(service)`` with the service name of a withdrawn one. Both are called on the
    event loop. ``name``: announced only when not empty (a name the user chose).
    """

    def __init__(
        self,
        *,
        node_id: str,
        mesh_id: str,
        name: str,
        port: int,
        protocol: int,
        interfaces: list[str] | None,
        on_found: Callable[[DiscoveredPeer], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self.node_id, self.mesh_id, self.name = node_id, mesh_id, name
        self.port, self.protocol = port, protocol
        self._interfaces = interfaces
        self._on_found, self._on_lost = on_found, on_lost
        self._azc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._tasks: set[asyncio.Task] = set()
        self._names: set[str] = set()   # service names of our mesh's records we reported
        self._other_versions: set[str] = set()   # node ids of our mesh on another protocol (warned)

    def _service_info(self, addresses: list[str]) -> AsyncServiceInfo:
        return AsyncServiceInfo(
            SERVICE_TYPE,
            f"{self.node_id}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(a) for a in addresses],
            port=self.port,
            properties=encode_txt(self.node_id, self.mesh_id, self.protocol, self.name),
            server=f"mn-{self.node_id}.local.",
        )

    async def start(self) -> None:
        # mDNS runs only on the interfaces we announce: the record is not multicast onto
        # VPNs and container bridges, and nothing is browsed there either.
        addresses = advertised_addresses(self._interfaces)
        self._azc = AsyncZeroconf(interfaces=addresses, ip_version=IPVersion.V4Only)
        self._info = self._service_info(addresses)
        # Names are unique (node id), so skip probing: the record is announced at once.
        await self._azc.async_register_service(self._info, cooperating_responders=True)
        self._browser = AsyncServiceBrowser(
            self._azc.zeroconf, [SERVICE_TYPE], handlers=[self._on_state_change]
        )
        log.debug("mDNS: advertising %s on port %d at %s", self._info.name, self.port, ", ".join(addresses))

    async def stop(self) -> None:
        """Withdraw our record and stop browsing (idempotent)."""
        azc, self._azc = self._azc, None
        if azc is None:
            return
        for t in list(self._tasks):
            t.cancel()
        try:
            if self._browser is not None:
                await self._browser.async_cancel()
            if self._info is not None:
                # Returns the task that sends the goodbyes (three, 125 ms apart): closing
                # before it ran sent none, and peers kept the record until its TTL ran out.
                goodbyes = await azc.async_unregister_service(self._info)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(goodbyes, GOODBYE_WAIT_S)
        finally:
            await azc.async_close()

    # ---- browsing -------------------------------------------------------------

    def _on_state_change(self, zeroconf: object, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            if name in self._names:
                self._names.discard(name)
                log.debug("mDNS: %s withdrawn", name)
                self._on_lost(name)
            return
        if len(self._tasks) >= MAX_RECORDS:   # a flood of records: resolve a bounded number at once
            return
        task = asyncio.get_running_loop().create_task(self._resolve(service_type, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, service_type: str, name: str) -> None:
        if self._azc is None:
            return
        info = AsyncServiceInfo(service_type, name)
        if not await info.async_request(self._azc.zeroconf, 1500):
            return
        rec = decode_txt(info.properties)
        if rec is None or rec["id"] == self.node_id:
            return
        if rec["mesh"] != self.mesh_id:
            log.debug("mDNS: ignoring %r of another mesh", rec["id"])
            return
        if rec["proto"] != self.protocol:
            # A member of this mesh on another meshnode release: say so once, as a warning
            # (the user sees a teammate missing and needs to know why)
            if rec["id"] not in self._other_versions and len(self._other_versions) < MAX_RECORDS:
                self._other_versions.add(rec["id"])
                who = f"{rec['id']} ({rec['name']})" if rec["name"] else rec["id"]
                log.warning("member %s runs another meshnode version (wire protocol %s, this node speaks %s): "
                            "left out until both run the same release", who, rec["proto"], self.protocol)
            return
        addrs = tuple(info.parsed_addresses(IPVersion.V4Only))[:MAX_ADDRESSES]
        if not addrs or not info.port:
            return
        if name not in self._names and len(self._names) >= MAX_RECORDS:
            log.warning("mDNS: more than %d records of this mesh; ignoring %s", MAX_RECORDS, name)
            return
        self._names.add(name)
        self._on_found(DiscoveredPeer(str(rec["id"]), str(rec["name"]), str(rec["mesh"]), int(rec["proto"]),  # type: ignore[call-overload]
                                      addrs, info.port, name))
