"""The sharing service in one process: real stores, real TLS sockets of the bulk channel,
the mesh link replaced by direct calls (the fabric is glue here; tests/test_share.py runs
real node processes)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time

import pytest

from meshnode import wire
from meshnode.bench.cluster import link_model
from meshnode.mesh.fabric import PeerReplyError
from meshnode.mesh.runtime import held_models
from meshnode.mesh.share import ShareService, mesh_models, resolve_mesh_model
from meshnode.models.transfer import TransferError, cached_manifest
from meshnode.net.bulk import BulkClient, BulkError
from meshnode.net.identity import Identity, cert_fingerprint
from meshnode.paths import NodePaths
from meshnode.state import Capabilities, PeerInfo

CS = 64 * 1024


class _Fabric:
    """Routes ShareRequest straight to the other services (as the QUIC link would)."""

    def __init__(self, name: str, paths: NodePaths, mesh: dict) -> None:
        self.paths, self.name, self.mesh = paths, name, mesh
        self.identity = Identity.load_or_create(paths.identity)
        self.node_id = self.identity.node_id
        self.caps: dict[str, Capabilities] = {}

    def peers(self) -> list[PeerInfo]:
        return [PeerInfo(nid, svc.fabric.name, "127.0.0.1:1", 0.1, True, self.caps.get(nid))
                for nid, svc in self.mesh.items() if nid != self.node_id]

    async def request(self, node_id: str, msg: wire.Message, timeout: float = 5.0) -> wire.Message:
        svc = self.mesh[node_id]
        replies: list[wire.Message] = []

        async def capture(_nid: str, reply: wire.Message) -> None:
            replies.append(reply)
        svc.fabric.send = capture
        await svc._answer(self.node_id, msg)
        if isinstance(replies[0], wire.Error):
            raise PeerReplyError(replies[0])
        return replies[0]


def _node(tmp_path, name: str, mesh: dict, model=None, *, enabled: bool = True) -> ShareService:
    paths = NodePaths.resolve(tmp_path / name).ensure()
    if model is not None:
        link_model(tmp_path / name, model)
    svc = ShareService(_Fabric(name, paths, mesh), paths, enabled=enabled, chunk_size=CS)
    mesh[svc.fabric.node_id] = svc
    return svc


def _advertise(mesh: dict) -> None:
    caps = {nid: Capabilities(1 << 30, models=tuple(held_models(s.paths, shared=s.enabled))) for nid, s in mesh.items()}
    for s in mesh.values():
        s.fabric.caps = caps


@pytest.fixture
def model(synthetic_gguf):
    return synthetic_gguf("tiny.gguf", n_embd=128, n_ff=256, vocab=512, n_layer=6)


def test_pull_from_two_sources_refetches_corrupt_chunks(tmp_path, model, caplog):
    """One holder's copy rotted after its record and manifest were made (a flipped byte in
    every chunk, mtime kept): it offers the right manifest and serves bad bytes; each bad
    chunk is detected, discarded and fetched from the good holder."""
    async def main() -> None:
        mesh: dict = {}
        good, bad = _node(tmp_path, "good", mesh, model), _node(tmp_path, "bad", mesh)
        puller = _node(tmp_path, "puller", mesh)
        copy = tmp_path / "bad" / "data" / "models" / "tiny" / "tiny.gguf"
        copy.parent.mkdir(parents=True)
        copy.write_bytes(model.read_bytes())
        held_models(bad.paths)               # the record of the original bytes
        cached_manifest(copy, bad.paths.cache / "manifests", CS)
        st = copy.stat()
        with open(copy, "r+b") as f:
            for off in range(100, st.st_size, CS):
                f.seek(off)
                b = f.read(1)
                f.seek(off)
                f.write(bytes([b[0] ^ 0xFF]))
        os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
        _advertise(mesh)
        for s in mesh.values():
            await s.start(0)
        try:
            entry, sources = resolve_mesh_model(puller.fabric, "tiny")
            assert sorted(sources) == sorted([good.fabric.node_id, bad.fabric.node_id])
            assert mesh_models(puller.fabric)[0]["holders"] and entry["n_layers"] == 6
            dest = puller.paths.models / "tiny.gguf"
            seen = []
            path, name = await puller.pull(entry["sha256"], dest, sources=sources, name="tiny",
                                           progress=seen.append)
            assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"] and name == "tiny"
            assert seen and seen[-1].done == seen[-1].total == model.stat().st_size
            assert not list(puller.paths.models.glob("*.part*"))
            bad_chunks = [r for r in caplog.records if "failed its sha256" in r.getMessage()]
            assert bad_chunks, "the corrupt source served no chunk"
        finally:
            for s in mesh.values():
                await s.close()

    asyncio.run(main())


def test_refusals_name_the_reason(tmp_path, model):
    async def main() -> None:
        mesh: dict = {}
        holder, puller = _node(tmp_path, "holder", mesh, model), _node(tmp_path, "puller", mesh)
        off = _node(tmp_path, "off", mesh, model, enabled=False)
        _advertise(mesh)
        for s in mesh.values():
            await s.start(0)
        sha = held_models(holder.paths)[0].sha256
        try:
            async def ask(svc, **kw) -> str:
                with pytest.raises(PeerReplyError) as e:
                    await puller.fabric.request(svc.fabric.node_id, wire.ShareRequest(ref=1, **kw))
                return e.value.error.message
            assert "holds no model" in await ask(holder, model_sha256="0" * 64, whole=True, layer_start=0, layer_end=0)
            msg = await ask(holder, model_sha256=sha, whole=False, layer_start=2, layer_end=99)
            assert "99" in msg and "6" in msg, msg
            assert "does not share" in await ask(off, model_sha256=sha, whole=True, layer_start=0, layer_end=0)
            # the bulk channel: a ticket is single-use and bounded to its chunks
            offer = await puller.fabric.request(holder.fabric.node_id, wire.ShareRequest(
                ref=2, model_sha256=sha, whole=True, layer_start=0, layer_end=0))
            n = len(offer.manifest["chunks"])
            c = BulkClient("127.0.0.1", offer.port, offer.cert_sha256, holder.fabric.node_id, offer.tickets[:32])
            with pytest.raises(BulkError, match="outside the ticket's range"):
                c.fetch(n, CS, bytearray(CS))
            c.close()
            with pytest.raises(BulkError, match="unknown or expired ticket"):
                BulkClient("127.0.0.1", offer.port, offer.cert_sha256, holder.fabric.node_id, offer.tickets[:32])
            with pytest.raises(BulkError, match="another certificate"):   # pinned: a wrong holder is refused
                BulkClient("127.0.0.1", offer.port, cert_fingerprint(puller.fabric.identity.certificate),
                           holder.fabric.node_id, offer.tickets[32:])
            # requests may run ahead of the answers (a puller asks for the next chunk before
            # it verifies this one): the holder answers them in order
            data = model.read_bytes()
            c = BulkClient("127.0.0.1", offer.port, offer.cert_sha256, holder.fabric.node_id, offer.tickets[64:96])
            for i in (2, 0, n - 1):
                c.request(i)
            for i in (2, 0, n - 1):
                assert bytes(c.receive(CS, bytearray(CS))) == data[i * CS:(i + 1) * CS]
            c.close()
            # a pull of a model no member shares fails with the reason, not a traceback
            with pytest.raises(TransferError, match="no member shares"):
                resolve_mesh_model(puller.fabric, "nope")
            assert holder.tickets.take(b"x" * 32, time.monotonic()) is None
        finally:
            for s in mesh.values():
                await s.close()

    asyncio.run(main())


def test_bulk_server_bounds_connections(tmp_path, monkeypatch):
    """Over the connection limit a connection is closed at once; one that sends no ticket
    gives its slot back after the handshake timeout."""
    import socket

    from meshnode.net import bulk
    from meshnode.net.bulk import BulkServer, TicketBook

    monkeypatch.setattr(bulk, "HANDSHAKE_TIMEOUT_S", 0.5)
    paths = NodePaths.resolve(tmp_path / "h").ensure()
    Identity.load_or_create(paths.identity)
    server = BulkServer(paths.identity, TicketBook(), port=0, max_connections=1)
    try:
        idle = socket.create_connection(("127.0.0.1", server.port))   # holds the only slot
        time.sleep(0.1)
        extra = socket.create_connection(("127.0.0.1", server.port))
        extra.settimeout(2)
        assert extra.recv(1) == b""                                   # closed at once
        idle.settimeout(3)
        t0 = time.monotonic()
        with contextlib.suppress(OSError):   # a reset counts as closed too
            assert idle.recv(1) == b""                                # dropped after the timeout
        assert time.monotonic() - t0 < 2.5
        time.sleep(0.1)
        again = socket.create_connection(("127.0.0.1", server.port))   # the slot is free again
        again.settimeout(0.3)
        with pytest.raises(socket.timeout):
            again.recv(1)                                             # held open: TLS expected
        again.close()
        idle.close()
        extra.close()
    finally:
        server.close()


def test_pulls_in_progress_are_the_snapshots_transfers(tmp_path):
    """What the TUI's transfers table and `status` show of a pull: name, range, bytes."""
    from meshnode.mesh.share import TransferInfo, TransferProgress

    svc = ShareService(None, NodePaths.resolve(tmp_path))
    svc.transfers[("a",)] = TransferInfo("smol", "ab" * 32, "model", ["n1"],
                                         TransferProgress(10, 40, 5.0, 6.0))
    svc.transfers[("b",)] = TransferInfo("smol", "ab" * 32, "layers [10, 20)", ["n1", "n2"])
    rows = svc.progress()
    assert [(r.name, r.done_bytes, r.total_bytes, r.what) for r in rows] == [
        ("smol", 10, 40, "pull"), ("smol layers [10, 20)", 0, 0, "pull")]


def test_a_split_model_is_pulled_part_by_part_and_checked_whole(tmp_path, model):
    """A split model comes as its parts, each a transfer of its own; the parts together
    must hash to the model's sha256, so a holder whose part changed under its record (a
    consistent but different file) fails the pull, and nothing of it is kept."""
    from meshnode.gguf_files import model_files
    from tests.gguf_split import split_gguf

    async def main() -> None:
        mesh: dict = {}
        first = split_gguf(model, tmp_path / "parts", 3)
        good = _node(tmp_path, "good", mesh, first)
        bad = _node(tmp_path, "bad", mesh, first)
        puller = _node(tmp_path, "puller", mesh)
        held_models(bad.paths)                # records the parts' sha256 ...
        third = model_files(bad.paths.models / "tiny" / first.name)[2]
        st = third.stat()
        third.unlink()                        # (a copy of its own, not the hard link)
        third.write_bytes(bytes(b ^ 0x01 for b in model_files(first)[2].read_bytes()))
        os.utime(third, ns=(st.st_atime_ns, st.st_mtime_ns))   # ... which stays trusted
        _advertise(mesh)
        for s in mesh.values():
            await s.start(0)
        try:
            entry, _ = resolve_mesh_model(puller.fabric, "tiny")
            dest = puller.paths.models / "m.gguf"
            with pytest.raises(TransferError, match="the parts of .* hash to .*: deleted"):
                await puller.pull(entry["sha256"], dest, sources=[bad.fabric.node_id])
            assert not list(puller.paths.models.glob("*.gguf*"))
            seen = []
            path, _ = await puller.pull(entry["sha256"], dest, sources=[good.fabric.node_id], progress=seen.append)
            got = model_files(path)
            assert [f.name for f in got] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
            assert [f.read_bytes() for f in got] == [f.read_bytes() for f in model_files(first)]
            assert {p.total for p in seen} == {f.stat().st_size for f in got}   # a progress per part
        finally:
            for s in mesh.values():
                await s.close()

    asyncio.run(main())
