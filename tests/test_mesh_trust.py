"""mDNS is an address hint only (issue #17, finding 7): real mDNS and QUIC on loopback.

A forger on the LAN sees our records and can announce anything under our mesh id (it is
public): capabilities, a member's node id at its own address, an id that is not the one
of the certificate found at that address. None of it may change what we believe about a
member: capabilities come from the authenticated link, a known member is redialled at
the address its authenticated link used, and a dialled peer must be the one announced.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from meshnode import PROTOCOL_VERSION
from meshnode.mesh.fabric import MeshFabric
from meshnode.net.discovery import SERVICE_TYPE, advertised_addresses, decode_txt, encode_txt
from meshnode.net.secret import new_secret
from meshnode.paths import NodePaths
from nodeproc import lo_multicast, until

pytestmark = pytest.mark.net




def _fabric(tmp_path, name: str, secret: bytes, **kw) -> MeshFabric:
    return MeshFabric(NodePaths.resolve(tmp_path / name).ensure(), secret=secret,
                      interfaces=["127.0.0.1"], name=name, **kw)


class _Announcer:
    """Somebody else's mDNS responder on loopback: announces whatever record it is told."""

    def __init__(self) -> None:
        self.azc = AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
        self.infos: list[AsyncServiceInfo] = []

    async def announce(self, service: str, node_id: str, mesh_id: str, port: int,
                       caps: dict | None = None, proto: int = PROTOCOL_VERSION, name: str = "") -> None:
        props = {"id": node_id, "mesh": mesh_id, "proto": str(proto)}
        if name:
            props["name"] = name
        if caps is not None:   # what the old record format carried: c0, c1 ... JSON
            import json
            blob = json.dumps(caps, separators=(",", ":"))
            props.update({f"c{i // 200}": blob[i:i + 200] for i in range(0, len(blob), 200)})
        info = AsyncServiceInfo(SERVICE_TYPE, f"{service}.{SERVICE_TYPE}",
                                addresses=[socket.inet_aton("127.0.0.1")], port=port,
                                properties=props, server=f"{service}.local.")
        await self.azc.async_register_service(info, cooperating_responders=True)
        self.infos.append(info)

    async def close(self) -> None:
        for info in self.infos:
            await self.azc.async_unregister_service(info)
        await self.azc.async_close()


def _udp_sink() -> tuple[socket.socket, int]:
    """A UDP socket that only counts what arrives (where a forged record points)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.setblocking(False)
    return s, s.getsockname()[1]


def _drain(s: socket.socket) -> int:
    n = 0
    while True:
        try:
            s.recv(65536)
        except BlockingIOError:
            return n
        n += 1


@pytest.mark.slow
@pytest.mark.skipif(not lo_multicast(), reason="multicast is off on lo")
async def test_forged_record_does_not_change_capabilities(tmp_path):
    s = new_secret()
    a, b = _fabric(tmp_path, "a", s), _fabric(tmp_path, "b", s)
    forger = _Announcer()
    await a.start()
    await b.start()
    try:
        await until(lambda: len(a.peers()) == 1, 3.0)
        real_ram = a.peers()[0].capabilities.free_ram_bytes
        huge = {"free_ram": 2**50, "free_vram": 2**50, "backend": "cuda", "cores": 4096, "speed": 1e6,
                "models": [{"name": "bait", "sha256": "ab" * 32, "layers": 99, "size": 1}]}
        # Under b's own service name (a responder that answers for b) and under another one.
        await forger.announce(b.node_id, b.node_id, a.mesh_id, b.port, caps=huge)
        await forger.announce("forged", b.node_id, a.mesh_id, b.port, caps=huge)
        await asyncio.sleep(2.0)   # a resolves the forged records (1.5 s resolve timeout)
        caps = a.peers()[0].capabilities
        assert caps.free_ram_bytes == real_ram and caps.cores != 4096 and not caps.models
    finally:
        await forger.close()
        await a.stop()
        await b.stop()


@pytest.mark.slow
@pytest.mark.skipif(not lo_multicast(), reason="multicast is off on lo")
async def test_announcement_does_not_redirect_a_known_member(tmp_path):
    # b announces nothing itself (no mDNS): a learns b only from the record announced here,
    # so b never dials a and every reconnection is a's redial.
    s = new_secret()
    a = _fabric(tmp_path, "a", s)
    b = _fabric(tmp_path, "b", s, discovery=False)
    honest, forger = _Announcer(), _Announcer()
    sink, sink_port = _udp_sink()
    await a.start()
    await b.start()
    try:
        await honest.announce(b.node_id, b.node_id, a.mesh_id, b.port)
        await until(lambda: len(a.peers()) == 1, 5.0)
        # The forger announces b's node id at its own address, then b's link drops.
        await forger.announce("forged-b", b.node_id, a.mesh_id, sink_port)
        await asyncio.sleep(2.0)
        _drain(sink)
        a._links[b.node_id].close_with("test: link dropped")   # noqa: SLF001
        await until(lambda: len(a.peers()) == 0, 2.0)
        await until(lambda: len(a.peers()) == 1, 5.0)
        assert a.peers()[0].address == f"127.0.0.1:{b.port}"
        assert _drain(sink) == 0, "a dialled the forged address first"
    finally:
        sink.close()
        await forger.close()
        await honest.close()
        await a.stop()
        await b.stop()


@pytest.mark.slow
@pytest.mark.skipif(not lo_multicast(), reason="multicast is off on lo")
async def test_dialled_peer_must_be_the_announced_node(tmp_path):
    # A record says node X is at c's address; c is a member, but not X: the link is dropped.
    s = new_secret()
    a = _fabric(tmp_path, "a", s)
    c = _fabric(tmp_path, "c", s, discovery=False)
    liar = _Announcer()
    await a.start()
    await c.start()
    try:
        claimed = "0000000000000001"   # lower than any real id: a dials at once
        await liar.announce("liar", claimed, a.mesh_id, c.port)
        await asyncio.sleep(3.0)
        assert a.peers() == [] and c.peers() == []
    finally:
        await liar.close()
        await a.stop()
        await c.stop()


def test_record_carries_no_capabilities_and_no_hostname():
    txt = encode_txt("abcd", "mesh", 1, "")
    assert set(txt) == {"id", "mesh", "proto"}
    named = encode_txt("abcd", "mesh", 1, "kitchen")
    assert named["name"] == "kitchen"
    rec = decode_txt({k.encode(): v.encode() for k, v in named.items()} | {b"c0": b'{"free_ram":1}'})
    assert rec is not None and "caps" not in rec


def test_advertised_addresses_skip_virtual_interfaces(monkeypatch):
    from types import SimpleNamespace as NS

    import meshnode.net.discovery as disc

    adapters = [
        NS(nice_name="lo", name="lo", ips=[NS(ip="127.0.0.1", network_prefix=8)]),
        NS(nice_name="eth0", name="eth0", ips=[NS(ip="192.168.1.20", network_prefix=24),
                                               NS(ip=("fe80::1", 0, 2), network_prefix=64)]),
        NS(nice_name="docker0", name="docker0", ips=[NS(ip="172.17.0.1", network_prefix=16)]),
        NS(nice_name="wg0", name="wg0", ips=[NS(ip="10.8.0.2", network_prefix=24)]),
        NS(nice_name="tailscale0", name="tailscale0", ips=[NS(ip="100.64.0.7", network_prefix=10)]),
        NS(nice_name="veth12ab", name="veth12ab", ips=[NS(ip="169.254.3.3", network_prefix=16)]),
    ]
    monkeypatch.setattr(disc.ifaddr, "get_adapters", lambda: adapters)
    monkeypatch.setattr(disc, "_default_route_address", lambda: "10.8.0.2")   # a full-tunnel VPN
    assert advertised_addresses(None) == ["192.168.1.20"]
    monkeypatch.setattr(disc, "_default_route_address", lambda: "192.168.1.20")
    assert advertised_addresses(None) == ["192.168.1.20"]
    assert advertised_addresses(["10.8.0.2"]) == ["10.8.0.2"]   # named by the user: used as given


EVIL = "\x1b]0;pwned\x07evil\x1b[2J\r\u202e"


def test_printable_removes_terminal_controls():
    from meshnode.state import printable

    out = printable(EVIL)
    assert out == "?]0;pwned?evil?[2J??" and not any(ord(c) < 32 or 0x7f <= ord(c) < 0xa0 for c in out)
    assert "\u202e" not in out and len(printable("x" * 1000)) == 200


def test_status_prints_an_evil_peer_name_without_control_characters(monkeypatch, capsys):
    import meshnode.cli.mesh as climesh
    from meshnode.cli import main

    caps = {"backend": "cpu", "cores": 2, "free_ram_bytes": 2**30,
            "models": [{"name": EVIL, "n_layers": 3}]}
    status = {"node": {"name": "me", "node_id": "n1", "mesh_id": "m", "address": "1.2.3.4:5",
                       "http_url": "http://x", "capabilities": caps},
              "model": EVIL, "stages": [{"index": 0, "layers": [0, 3], "node_id": "n2", "node": EVIL,
                                         "state": "ready", "detail": EVIL}],
              "peers": [{"node_id": "n2", "name": EVIL, "address": "1.2.3.4:6", "rtt_ms": 1.0,
                         "authenticated": True, "capabilities": caps}]}
    monkeypatch.setattr(climesh, "fetch_status", lambda paths, timeout=5.0: status)
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "evil" in out and "\x1b" not in out and "\x07" not in out and "\r" not in out


def test_nodes_that_share_a_name_are_told_apart_by_their_ids(monkeypatch, capsys):
    # two laptops that kept the hostname they shipped with, and one named apart
    from meshnode.state import node_labels

    labels = node_labels([("a1b2c3d4e5", "ubuntu"), ("f6e5d4c3b2", "ubuntu"), ("0099", "mac")])
    assert labels == {"a1b2c3d4e5": "ubuntu#a1b2c3", "f6e5d4c3b2": "ubuntu#f6e5d4", "0099": "mac"}
    long = node_labels([("a1b2c3d4e5", "x" * 30), ("f6e5d4c3b2", "x" * 30)], width=16)
    assert long["a1b2c3d4e5"] == "x" * 9 + "#a1b2c3"           # the name is cut, never the id
    assert node_labels([("a1", EVIL)])["a1"] == "?]0;pwned?evil?[2J??"

    import meshnode.cli.mesh as climesh
    from meshnode.cli import main

    status = {"node": {"name": "ubuntu", "node_id": "a1b2c3d4e5", "mesh_id": "m", "address": "1.2.3.4:5",
                       "http_url": "http://x", "capabilities": None},
              "model": "m", "stages": [{"index": i, "layers": [3 * i, 3 * i + 3], "node_id": nid, "node": "ubuntu",
                                        "state": "ready"} for i, nid in enumerate(("a1b2c3d4e5", "f6e5d4c3b2"))],
              "peers": [{"node_id": "f6e5d4c3b2", "name": "ubuntu", "address": "1.2.3.4:6", "rtt_ms": 1.0,
                         "authenticated": True, "capabilities": None}]}
    monkeypatch.setattr(climesh, "fetch_status", lambda paths, timeout=5.0: status)
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "stage 0: layers [0,3) on ubuntu#a1b2c3" in out and "stage 1: layers [3,6) on ubuntu#f6e5d4" in out
    assert "\nubuntu#f6e5d4 " in out                             # the peer's row


def test_tui_cells_of_peer_text_are_clean_and_not_markup():
    from ui.format import peer_text

    cell = peer_text(EVIL + "[bold red]x")
    assert "\x1b" not in cell.plain and cell.plain.endswith("[bold red]x") and not cell.spans


@pytest.mark.skipif(not lo_multicast(), reason="multicast is off on lo")
async def test_a_member_on_another_release_is_named_once_and_left_out(tmp_path, caplog):
    """A teammate who upgraded (or did not) is missing from the mesh: the log says who
    and why, once, however often the record is announced."""
    a = _fabric(tmp_path, "a", new_secret())
    other = _Announcer()
    sink, port = _udp_sink()
    await a.start()
    try:
        with caplog.at_level("WARNING", logger="meshnode.net.discovery"):
            await other.announce("old1", "oldnode", a.mesh_id, port, proto=PROTOCOL_VERSION - 1, name="bob-laptop")
            await other.announce("old2", "oldnode", a.mesh_id, port, proto=PROTOCOL_VERSION - 1, name="bob-laptop")
            await until(lambda: any("another meshnode version" in r.message for r in caplog.records), 5.0)
            await asyncio.sleep(1.0)
        lines = [r.message for r in caplog.records if "another meshnode version" in r.message]
        assert len(lines) == 1
        assert "oldnode (bob-laptop)" in lines[0] and f"this node speaks {PROTOCOL_VERSION}" in lines[0]
        assert not a.peers() and _drain(sink) == 0     # never dialled
    finally:
        await other.close()
        await a.stop()
        sink.close()


def test_status_says_what_a_node_fetches_before_its_model_is_known(monkeypatch, capsys):
    import meshnode.cli.mesh as climesh
    from meshnode.cli import main

    status = {"node": {"name": "me", "node_id": "n1", "mesh_id": "m", "address": "1.2.3.4:5",
                       "http_url": "http://x", "capabilities": None},
              "model": None, "stages": [], "peers": [], "status": "fetching", "status_detail": "hf:o/r:Q4_K_M",
              "progress": [{"name": "hf:o/r:Q4_K_M (download 2/3)", "what": "download 2/3",
                            "done_bytes": 1_500_000_000, "total_bytes": 4_000_000_000}]}
    monkeypatch.setattr(climesh, "fetch_status", lambda paths, timeout=5.0: status)
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "model  fetching: hf:o/r:Q4_K_M" in out
    assert "download 2/3 hf:o/r:Q4_K_M (download 2/3): 1500.0 of 4000.0 MB (38%)" in out
