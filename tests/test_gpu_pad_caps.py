"""Each node's GPU pad width travels in its capabilities, so the coordinator caps a GPU
stage's verify windows at that node's width, not its own (spec/window.py): a coordinator
padding to 8 rows must not send 8-row windows to a stage that pads to 2."""

from __future__ import annotations

import pytest

from meshnode.mesh.fabric import MeshFabric
from meshnode.mesh.local_caps import local_capabilities
from meshnode.net.auth import check_capabilities
from meshnode.net.caps import from_dict, to_dict
from meshnode.net.secret import new_secret
from meshnode.paths import NodePaths
from meshnode.state import Capabilities
from nodeproc import until


def test_the_pad_width_round_trips_and_an_older_peer_reads_as_unsaid():
    assert from_dict(to_dict(Capabilities(1 << 30, backend="cuda", gpu_pad_rows=8))).gpu_pad_rows == 8
    assert from_dict({"free_ram": 1, "backend": "cuda"}).gpu_pad_rows == 0     # no key: the default width


@pytest.mark.parametrize("bad", [9, -1, "8", True, 2.0, None])
def test_a_profile_with_a_bad_pad_width_is_refused_before_authentication(bad):
    assert check_capabilities({"free_ram": 1, "gpu_pad": 8}) is None
    assert check_capabilities({"free_ram": 1, "gpu_pad": 0}) is None
    assert "bad gpu_pad" in check_capabilities({"free_ram": 1, "gpu_pad": bad})


def test_a_node_advertises_the_width_it_pads_to(monkeypatch):
    monkeypatch.setenv("MESHNODE_GPU_PAD_ROWS", "8")
    assert local_capabilities().gpu_pad_rows == 8
    monkeypatch.delenv("MESHNODE_GPU_PAD_ROWS")
    assert local_capabilities().gpu_pad_rows == 2


@pytest.mark.parametrize(("raw", "width"), [(None, 1), ("2", 2), ("8", 8), ("0", 1), ("9", 1), ("two", 1)])
def test_cpu_engines_pad_only_when_told_and_within_range(monkeypatch, raw, width):
    from meshnode.limits import cpu_pad_rows

    if raw is None:
        monkeypatch.delenv("MESHNODE_CPU_PAD_ROWS", raising=False)
    else:
        monkeypatch.setenv("MESHNODE_CPU_PAD_ROWS", raw)
    assert cpu_pad_rows() == width


def _fabric(tmp_path, name: str, secret: bytes, **kw) -> MeshFabric:
    return MeshFabric(NodePaths.resolve(tmp_path / name).ensure(), secret=secret, name=name, discovery=False,
                      bind_host="127.0.0.1", **kw)


@pytest.mark.net
async def test_a_peers_pad_width_reaches_the_coordinator_over_the_link(tmp_path, monkeypatch):
    s = new_secret()
    a = _fabric(tmp_path, "a", s)
    await a.start()
    monkeypatch.setenv("MESHNODE_GPU_PAD_ROWS", "6")
    b = _fabric(tmp_path, "b", s, static_peers=[f"127.0.0.1:{a.port}"])   # measures its own capabilities
    monkeypatch.delenv("MESHNODE_GPU_PAD_ROWS")
    await b.start()
    try:
        await until(lambda: len(a.peers()) == 1 and a.peers()[0].capabilities is not None, 5.0)
        assert a.peers()[0].capabilities.gpu_pad_rows == 6
        assert from_dict(a.capabilities).gpu_pad_rows == 2          # a's own width is its own
    finally:
        await b.stop()
        await a.stop()
