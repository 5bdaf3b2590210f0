"""mDNS discovery of peers (zeroconf, asyncio API).

Each node registers ``<node_id>._meshnode._udp.local.`` with its QUIC port in the SRV
record and a TXT record holding: ``id`` (node id), ``mesh`` (mesh id: a hash, never
the secret), ``proto`` (protocol version), ``name``, and the capability summary as
compact JSON split over ``c0``, ``c1``... (a TXT string holds at most 255 bytes).
:meth:`Discovery.update` re-announces the record when capabilities change;
:meth:`Discovery.stop` withdraws it (goodbye packets), so peers drop it at once.

Records of other meshes, of other protocol versions and our own are ignored. mDNS is
only a hint: membership is decided by authenticated QUIC links (a killed process sends
no goodbye, its record lingers in caches).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zeroconf import IPVersion, ServiceStateChange, get_all_addresses
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger(__name__)

SERVICE_TYPE = "_meshnode._udp.local."
_CHUNK = 200


@dataclass(frozen=True, slots=True)
class DiscoveredPeer:
    node_id: str
    name: str
    mesh_id: str
    protocol: int
    addresses: tuple[str, ...]
    port: int
    capabilities: dict[str, Any] = field(default_factory=dict)


def encode_txt(node_id: str, mesh_id: str, protocol: int, name: str, caps: dict[str, Any]) -> dict[str, str]:
    props = {"id": node_id, "mesh": mesh_id, "proto": str(protocol), "name": name[:100]}
    blob = json.dumps(caps, separators=(",", ":"), sort_keys=True)
    for i in range(0, max(len(blob), 1), _CHUNK):
        props[f"c{i // _CHUNK}"] = blob[i : i + _CHUNK]
    return props


def decode_txt(props: dict[bytes, bytes | None]) -> dict[str, Any] | None:
    p = {k.decode("utf-8", "replace"): (v or b"").decode("utf-8", "replace") for k, v in props.items()}
    try:
        chunks, i = [], 0
        while f"c{i}" in p:
            chunks.append(p[f"c{i}"])
            i += 1
        caps = json.loads("".join(chunks)) if chunks else {}
        return {"id": p["id"], "mesh": p["mesh"], "proto": int(p["proto"]), "name": p.get("name", ""), "caps": caps}
    except (KeyError, ValueError):
        return None


def advertised_addresses(interfaces: list[str] | None) -> list[str]:
    """IPv4 addresses to put in our record: the chosen interfaces, else all but loopback."""
    if interfaces:
        return [a for a in interfaces if _is_ipv4(a)] or ["127.0.0.1"]
    addrs = [a for a in get_all_addresses() if not a.startswith("127.")]
    return addrs or ["127.0.0.1"]


def _is_ipv4(a: str) -> bool:
    try:
        socket.inet_aton(a)
        return a.count(".") == 3
    except OSError:
        return False


class Discovery:
    """Advertise this node and browse for peers of the same mesh.

    ``on_found(peer)`` is called for new and updated records of our mesh, ``on_lost(node_id)``
    when a record is withdrawn. Both are called on the event loop.
    """

    def __init__(
        self,
        *,
        node_id: str,
        mesh_id: str,
        name: str,
        port: int,
        protocol: int,
        capabilities: dict[str, Any],
        interfaces: list[str] | None,
        on_found: Callable[[DiscoveredPeer], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self.node_id, self.mesh_id, self.name = node_id, mesh_id, name
        self.port, self.protocol = port, protocol
        self._caps = capabilities
        self._interfaces = interfaces
        self._on_found, self._on_lost = on_found, on_lost
        self._azc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._tasks: set[asyncio.Task] = set()
        self._names: dict[str, str] = {}  # service name -> node id

    def _service_info(self) -> AsyncServiceInfo:
        return AsyncServiceInfo(
            SERVICE_TYPE,
            f"{self.node_id}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(a) for a in advertised_addresses(self._interfaces)],
            port=self.port,
            properties=encode_txt(self.node_id, self.mesh_id, self.protocol, self.name, self._caps),
            server=f"mn-{self.node_id}.local.",
        )

    async def start(self) -> None:
        from zeroconf import InterfaceChoice

        self._azc = AsyncZeroconf(
            interfaces=self._interfaces or InterfaceChoice.All, ip_version=IPVersion.V4Only
        )
        self._info = self._service_info()
        # Names are unique (node id), so skip probing: the record is announced at once.
        await self._azc.async_register_service(self._info, cooperating_responders=True)
        self._browser = AsyncServiceBrowser(
            self._azc.zeroconf, [SERVICE_TYPE], handlers=[self._on_state_change]
        )
        log.debug("mDNS: advertising %s on port %d", self._info.name, self.port)

    async def update(self, capabilities: dict[str, Any]) -> None:
        """Re-announce the record with new capabilities (no-op when unchanged)."""
        if capabilities == self._caps:
            return
        self._caps = capabilities
        if self._azc is not None and self._info is not None:
            self._info = self._service_info()
            await self._azc.async_update_service(self._info)

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
                await azc.async_unregister_service(self._info)
        finally:
            await azc.async_close()

    # ---- browsing -------------------------------------------------------------

    def _on_state_change(self, zeroconf: Any, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            node_id = self._names.pop(name, None)
            if node_id is not None:
                log.debug("mDNS: %s withdrawn", node_id)
                self._on_lost(node_id)
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
            log.debug("mDNS: ignoring %s of another mesh", rec["id"])
            return
        if rec["proto"] != self.protocol:
            log.info("mDNS: ignoring %s (%s): protocol %s, ours %s", rec["id"], rec["name"], rec["proto"], self.protocol)
            return
        addrs = tuple(info.parsed_addresses(IPVersion.V4Only))
        if not addrs or not info.port:
            return
        self._names[name] = rec["id"]
        self._on_found(
            DiscoveredPeer(rec["id"], rec["name"], rec["mesh"], rec["proto"], addrs, info.port, rec["caps"])
        )
