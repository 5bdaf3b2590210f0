"""Model sharing end to end: real node processes on loopback (real mDNS, QUIC, TLS bulk
channel, HTTP); a node with an empty store fetches its layers from the holders."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from meshnode.gguf_files import model_files
from tests.gguf_split import split_gguf
from tests.nodeproc import meshnode_cmd, start_node, wait_for
from tests.test_split_serving import (  # noqa: F401 - single_node_outputs is a fixture
    NODE_FLAGS,
    _complete_all,
    _home_with_model,
    _same_mesh,
    _wait_ready,
    single_node_outputs,
)

pytestmark = [pytest.mark.slow, pytest.mark.net]


@contextlib.contextmanager
def _stopped_after(nodes: list):
    """``nodes`` (a test appends the ones it starts) stopped at the end; their logs
    printed when the test fails."""
    try:
        yield nodes
    except BaseException:
        for n in nodes:
            print(n.log()[-4000:])
        raise
    finally:
        for n in nodes:
            n.stop()


def test_empty_store_serves_middle_stage(smollm2, single_node_outputs, tmp_path):  # noqa: F811
    """n1 holds nothing: Prepare fetches the middle package (from n0 and n2, verified chunk
    by chunk) and the 3-stage split's greedy text equals one node's."""
    homes = [_home_with_model(tmp_path, "n0", smollm2.path), tmp_path / "n1",
             _home_with_model(tmp_path, "n2", smollm2.path)]
    (tmp_path / "n1").mkdir()
    _same_mesh(homes)
    helpers = [start_node(homes[i], f"n{i}", "--no-model", *NODE_FLAGS) for i in (1, 2)]
    with _stopped_after(list(helpers)) as nodes:
        for h in helpers:
            h.wait_up(30)
        coord = start_node(homes[0], "n0", "--model", str(smollm2.path), "--split", "3", *NODE_FLAGS).wait_up(30)
        nodes.append(coord)
        _wait_ready(coord, 180)
        stages = coord.status()["stages"]
        assert [s["state"] for s in stages] == ["ready"] * 3, stages
        assert stages[1]["node_id"] == helpers[0].node_id, stages   # the empty node took the middle
        assert _complete_all(coord.info["http_port"]) == single_node_outputs
        slices = list((homes[1]).rglob("*.gguf"))
        assert len(slices) == 1 and "slices" in str(slices[0]), slices   # the package, in the slice cache
        assert not list(homes[1].rglob("*.part")), "no partial file is left"
        assert not any(p.name.endswith(".gguf") for p in Path(homes[1]).rglob("models/*"))
        # n1 now advertises the rate its fetch moved at: what the planner counts next time

        def measured() -> float:
            peer = next(p for p in coord.status()["peers"] if p["node_id"] == helpers[0].node_id)
            return (peer.get("capabilities") or {}).get("fetch_bytes_per_s", 0)
        wait_for(lambda: measured() > 0, 10)


def test_a_split_model_is_served_split_by_a_node_with_an_empty_store(smollm2, single_node_outputs, tmp_path):  # noqa: F811
    """n0 holds SmolLM2 as 3 files (llama-gguf-split's parts), n1 nothing: n1 fetches the
    package of its layers, sliced from the parts, and the greedy text equals the whole
    file's on one node; then n1 pulls the whole split model, every part."""
    first = split_gguf(smollm2.path, tmp_path / "parts", 3)
    homes = [_home_with_model(tmp_path, "n0", first), tmp_path / "n1"]
    homes[1].mkdir()
    _same_mesh(homes)
    helper = start_node(homes[1], "n1", "--no-model", *NODE_FLAGS)
    with _stopped_after([helper]) as nodes:
        helper.wait_up(30)
        coord = start_node(homes[0], "n0", "--model", str(first), "--split", "2", *NODE_FLAGS).wait_up(30)
        nodes.append(coord)
        _wait_ready(coord, 180)
        stages = coord.status()["stages"]
        assert [s["state"] for s in stages] == ["ready"] * 2 and stages[1]["node_id"] == helper.node_id, stages
        assert _complete_all(coord.info["http_port"]) == single_node_outputs
        (package,) = homes[1].rglob("*.gguf")
        assert "slices" in str(package)
        # the whole split model: part by part, the parts together checked against its sha256
        sha = coord.status()["node"]["capabilities"]["models"][0]["sha256"]
        pulled = meshnode_cmd("models", "pull", sha, "--home", str(homes[1]))
        assert pulled.returncode == 0, pulled
        listed = json.loads(meshnode_cmd("models", "list", "--json", "--home", str(homes[1])).stdout)
        assert [(m["sha256"], len(m["files"])) for m in listed] == [(sha, 3)], listed
        assert [Path(f).read_bytes() for f in listed[0]["files"]] == [f.read_bytes() for f in model_files(first)]
