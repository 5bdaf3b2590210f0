"""Pulls between nodes on their own addresses (network namespaces, a tc-shaped link):
a puller killed with SIGKILL mid-transfer leaves no visible model and resumes from the
chunks it recorded; a node of another mesh sees nothing to pull. Needs root; skipped
with the reason otherwise."""

from __future__ import annotations

import json
import signal

import pytest

from meshnode.bench.cluster import link_model
from meshnode.bench.netns import Netns, unavailable
from tests.nodeproc import env, meshnode_argv, meshnode_cmd, start_node_in, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.netns]


@pytest.fixture(scope="module")
def netns_ok() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)


def _holders(node) -> int:
    models = node.get("/mesh/models")["models"]
    return len(models[0]["holders"]) if models else 0


def test_killed_puller_resumes_and_other_mesh_sees_nothing(netns_ok, smollm2, tmp_path):
    holder, puller, stranger = tmp_path / "holder", tmp_path / "puller", tmp_path / "stranger"
    link_model(holder, smollm2.path)
    link_model(stranger, smollm2.path)
    puller.mkdir()
    tok = meshnode_cmd("invite", "--home", str(holder)).stdout.strip().splitlines()[-1]
    assert meshnode_cmd("join", tok, "--home", str(puller)).returncode == 0
    with Netns(3) as net:
        h = start_node_in(net, 0, holder, "holder", "--no-model").wait_up(30)
        p = start_node_in(net, 1, puller, "puller", "--no-model").wait_up(30)
        s = start_node_in(net, 2, stranger, "stranger", "--no-model").wait_up(30)   # another mesh
        nodes = [h, p, s]
        try:
            wait_for(lambda: _holders(p) == 1, 30)
            # a node of another mesh: its link to the others never authenticates, so it
            # lists nothing and cannot pull
            assert _holders(s) == 0 and s.get("/mesh/models")["models"] == []
            with net.inside(2):
                r = meshnode_cmd("models", "pull", "smollm2", "--home", str(stranger))
            assert r.returncode != 0 and "no member shares" in r.stderr and "Traceback" not in r.stderr

            net.shape(1, "40mbit")   # ~20 s for the model: time to kill the puller halfway
            name = p.get("/mesh/models")["models"][0]["name"]
            pull = net.popen(1, meshnode_argv("models", "pull", name, "--home", str(puller)), env=env(),
                             stdout=open(tmp_path / "pull1.log", "wb"), stderr=open(tmp_path / "pull1.err", "wb"))
            record = puller / "data" / "models" / f"{name}.gguf.part.json"

            def recorded() -> int:
                try:
                    return len(json.loads(record.read_text())["chunks"])
                except (OSError, ValueError, KeyError):
                    return 0
            wait_for(lambda: recorded() >= 3, 60)
            p.proc.send_signal(signal.SIGKILL)
            p.proc.wait(10)
            pull.wait(30)
            assert pull.returncode != 0
            have = recorded()
            # no visible partial model: the store lists nothing
            listed = json.loads(meshnode_cmd("models", "list", "--json", "--home", str(puller)).stdout)
            assert listed == []

            net.unshape(1)
            p = start_node_in(net, 1, puller, "puller", "--no-model").wait_up(30)
            nodes[1] = p
            wait_for(lambda: _holders(p) == 1, 30)
            with net.inside(1):
                r = meshnode_cmd("models", "pull", name, "--home", str(puller), timeout=120)
            assert r.returncode == 0, r.stderr
            assert f"chunks already here" in p.log() and f"{have} of" in p.log()
            # the node recorded the sha256 it verified before it answered: listing the store
            # hashes nothing (a CLI and the node used to hash the new file at once)
            meta = json.loads((puller / "data" / "models" / f"{name}.gguf.meta.json").read_text())
            assert meta["sha256"] == smollm2.sha256
            listed = json.loads(meshnode_cmd("models", "list", "--json", "--home", str(puller)).stdout)
            assert [m["sha256"] for m in listed] == [smollm2.sha256]   # verified: the holder's bytes
            assert not list((puller / "data" / "models").glob("*.part*"))
        except BaseException:
            for n in nodes:
                print(f"--- {n.name}\n{n.log()[-3000:]}")
            raise
        finally:
            for n in nodes:
                n.stop()
