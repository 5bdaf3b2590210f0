"""Unit tests of the transfer core: manifests, the chunk plan, the part file (real files)."""

from __future__ import annotations

import os

import pytest

from meshnode.models.transfer import (
    MAX_BAD_CHUNKS,
    ChunkPlan,
    Manifest,
    PartFile,
    TransferError,
    build_manifest,
    cached_manifest,
    check_free_space,
    chunk_ok,
)

CS = 64 * 1024


@pytest.fixture
def blob(tmp_path):
    p = tmp_path / "src.bin"
    p.write_bytes(os.urandom(5 * CS + 123))
    return p


def test_manifest_chunks_and_bounds(blob, tmp_path):
    m = build_manifest(blob, CS)
    assert m.n_chunks == 6 and m.span(5) == (5 * CS, 123)
    data = blob.read_bytes()
    assert all(chunk_ok(m, i, data[i * CS:(i + 1) * CS]) for i in range(6))
    assert not chunk_ok(m, 0, bytes([data[0] ^ 1]) + data[1:CS])   # (b"x" + ... was the chunk 1 time in 256)
    assert Manifest.from_dict(m.to_dict()) == m
    for bad in ({**m.to_dict(), "size": -1}, {**m.to_dict(), "chunk_size": 1},
                {**m.to_dict(), "chunks": m.chunks[:-1]}, {**m.to_dict(), "sha256": "zz"}, [1]):
        with pytest.raises(TransferError):
            Manifest.from_dict(bad)
    # cached: computed once, recomputed when the file changes
    c1 = cached_manifest(blob, tmp_path / "cache", CS)
    assert c1 == m and len(list((tmp_path / "cache").iterdir())) == 1
    blob.write_bytes(b"y" * (CS + 1))
    assert cached_manifest(blob, tmp_path / "cache", CS).size == CS + 1


def test_plan_refetches_bad_chunk_from_another_source():
    plan = ChunkPlan(3, ["a", "b"])
    i = plan.next_for("a")
    plan.chunk_bad(i, "a")
    assert plan.next_for("a") != i          # a bad chunk goes to the other source first
    assert plan.next_for("b") == i
    plan2 = ChunkPlan(2, ["a"])
    i = plan2.next_for("a")
    plan2.chunk_bad(i, "a")
    assert plan2.next_for("a") == i         # ... or back to the only one
    for _ in range(MAX_BAD_CHUNKS - 1):
        plan2.chunk_bad(i, "a")
    assert plan2.alive() == [] and "bad chunks" in plan2.why_stuck()


def test_plan_resume_and_source_failure():
    plan = ChunkPlan(4, ["a", "b"], done=[0, 2])
    got = {plan.next_for("a"), plan.next_for("b")}
    assert got == {1, 3} and plan.next_for("a") is None and plan.busy
    plan.source_failed("b", "gone", 3)
    assert plan.next_for("a") == 3
    plan.chunk_done(1)
    plan.chunk_done(3)
    assert plan.complete and not plan.busy


def test_part_file_resumes_and_renames_only_when_whole(blob, tmp_path):
    m = build_manifest(blob, CS)
    data = blob.read_bytes()
    dest = tmp_path / "store" / "m.gguf"
    dest.parent.mkdir()
    part = PartFile(dest, m)
    for i in (0, 3):
        part.write(i, data[i * CS:(i + 1) * CS])
    part.close()                             # killed here: the record names what is written
    assert not dest.exists() and part.part.exists()
    # ...or killed while rewriting the record: atomic_write's temp file is left beside it
    stale = part.record.with_name(f".{part.record.name}.k1ll3d.part")
    stale.write_text('{"sha256": ')
    again = PartFile(dest, m)
    assert again.done == {0, 3} and again.bytes_held == 2 * CS
    assert not stale.exists()
    for i in (1, 2, 4, 5):
        again.write(i, data[i * CS:(i + 1) * CS])
    assert again.finish() == dest and dest.read_bytes() == data
    assert not again.part.exists() and not again.record.exists()


def test_part_file_records_chunks_while_the_transfer_runs(blob, tmp_path, monkeypatch):
    """The part file's own thread records written chunks every CHECKPOINT_S (no close
    needed: a puller killed mid-transfer resumes from them), and hashes chunks written out
    of order once the ones before them are there."""
    import json
    import time

    import meshnode.models.transfer as transfer

    monkeypatch.setattr(transfer, "CHECKPOINT_S", 0.05)
    m = build_manifest(blob, CS)
    data = blob.read_bytes()
    part = PartFile(tmp_path / "m.gguf", m)
    for i in (4, 1, 0):
        part.write(i, data[i * CS:(i + 1) * CS])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rec = json.loads(part.record.read_text()) if part.record.exists() else {}
        if rec.get("chunks") == [0, 1, 4]:
            break
        time.sleep(0.02)
    assert rec.get("chunks") == [0, 1, 4]
    for i in (5, 3, 2):
        part.write(i, data[i * CS:(i + 1) * CS])
    assert part.finish().read_bytes() == data


def test_part_file_refuses_a_wrong_whole(blob, tmp_path):
    m = build_manifest(blob, CS)
    dest = tmp_path / "m.gguf"
    part = PartFile(dest, m)
    for i in range(m.n_chunks):
        part.write(i, b"\0" * m.span(i)[1])   # the chunks' check bypassed: the whole still catches it
    with pytest.raises(TransferError, match="sha256"):
        part.finish()
    assert not dest.exists() and not part.part.exists()


def test_free_space_check(tmp_path):
    check_free_space(tmp_path, 1)
    with pytest.raises(TransferError, match="free space"):
        check_free_space(tmp_path, 1 << 60)
