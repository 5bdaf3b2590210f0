"""Real node processes on loopback: mDNS discovery, QUIC, mesh auth, status, kill.

Needs multicast on lo (`ip link set lo multicast on`; .ci/run does it).
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from nodeproc import lo_multicast, meshnode_cmd, start_node, wait_for

pytestmark = [pytest.mark.net, pytest.mark.slow]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    if not lo_multicast():
        pytest.skip("multicast is off on lo (ip link set lo multicast on)")
    root = tmp_path_factory.mktemp("mesh")
    r = meshnode_cmd("invite", "--home", str(root / "a"))
    assert r.returncode == 0, r.stderr
    token = r.stdout.strip().splitlines()[-1]
    for h in ("b", "c"):
        r = meshnode_cmd("join", token, "--home", str(root / h))
        assert r.returncode == 0, r.stderr
    nodes = [start_node(root / h, n) for h, n in (("a", "alpha"), ("b", "beta"), ("c", "gamma"))]
    try:
        for n in nodes:
            n.wait_up()
        # The intruder has its own secret and dials alpha directly (it advertises another
        # mesh id over mDNS, so discovery alone would never connect it).
        intruder = start_node(root / "x", "intruder", "--peer", f"127.0.0.1:{nodes[0].quic_port}")
        intruder.wait_up()
        yield nodes, intruder
    finally:
        for n in nodes + [locals().get("intruder")]:
            if n is not None:
                n.stop(signal.SIGKILL)


def test_three_nodes_discover_and_authenticate(mesh):
    nodes, intruder = mesh
    names = {n.name for n in nodes}
    took = wait_for(lambda: all(n.peer_names() == names - {n.name} for n in nodes), timeout=5)
    assert took < 2.0 + 1.0  # they started within the last second or so
    for n in nodes:
        st = n.status()
        assert st["node"]["name"] == n.name and st["node"]["node_id"] == n.node_id
        for p in st["peers"]:
            assert p["authenticated"] is True
            assert p["address"].startswith("127.0.0.1:")
            assert p["capabilities"]["cores"] >= 1
    # control messages flow: heartbeats give an RTT on every link
    wait_for(lambda: all(p["rtt_ms"] is not None for n in nodes for p in n.status()["peers"]), timeout=3)


def test_wrong_secret_refused_and_never_listed(mesh):
    nodes, intruder = mesh
    alpha = nodes[0]
    wait_for(lambda: "wrong mesh secret" in alpha.log() and "another mesh" in intruder.log(), timeout=5)
    for _ in range(10):
        for n in nodes:
            assert "intruder" not in n.peer_names()
        assert intruder.status()["peers"] == []
        time.sleep(0.05)
    assert "refused" in alpha.log() and "refused" in intruder.log()


def test_status_command_json_and_table(mesh):
    nodes, _ = mesh
    wait_for(lambda: len(nodes[0].status()["peers"]) == 2, timeout=5)
    r = meshnode_cmd("status", "--home", str(nodes[0].home), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data) >= {"node", "peers"}
    for p in data["peers"]:
        assert {"name", "address", "rtt_ms", "authenticated", "lane"} <= set(p)
    # the fast lane comes up beside every link (a probe answered over it)
    wait_for(lambda: all(p["lane"] for p in nodes[0].status()["peers"]), timeout=5)
    r = meshnode_cmd("status", "--home", str(nodes[0].home))
    assert r.returncode == 0 and "beta" in r.stdout and "gamma" in r.stdout
    assert r.stdout.count("yes+lane") == 2


def test_killed_node_disappears_within_2s(mesh):
    nodes, _ = mesh
    alpha, beta, gamma = nodes
    wait_for(lambda: gamma.name in alpha.peer_names() and gamma.name in beta.peer_names(), timeout=5)
    gamma.proc.send_signal(signal.SIGKILL)
    gamma.proc.wait()
    took = wait_for(lambda: gamma.name not in alpha.peer_names() and gamma.name not in beta.peer_names(),
                    timeout=4, interval=0.02)
    assert took < 2.0
    assert alpha.peer_names() == {"beta"}


def test_clean_stop_withdraws_and_removes_runtime_file(mesh):
    nodes, _ = mesh
    alpha, beta, _ = nodes
    wait_for(lambda: beta.name in alpha.peer_names(), timeout=5)
    assert beta.stop(signal.SIGTERM) == 0
    assert not (beta.home / "state" / "node.json").exists()
    took = wait_for(lambda: beta.name not in alpha.peer_names(), timeout=3, interval=0.02)
    assert took < 2.0
    r = meshnode_cmd("status", "--home", str(beta.home))
    assert r.returncode != 0 and "no node is running" in r.stderr


def test_invite_join_cli(tmp_path):
    r = meshnode_cmd("invite", "--home", str(tmp_path / "a"))
    assert r.returncode == 0
    token = r.stdout.strip().splitlines()[-1]
    assert meshnode_cmd("invite", "--home", str(tmp_path / "a")).stdout.strip().splitlines()[-1] == token
    bad = meshnode_cmd("join", token[:-4] + "AAAA", "--home", str(tmp_path / "b"))
    assert bad.returncode != 0 and "invalid join token" in bad.stderr
    ok = meshnode_cmd("join", token, "--home", str(tmp_path / "b"))
    assert ok.returncode == 0
    assert meshnode_cmd("invite", "--home", str(tmp_path / "b")).stdout.strip().splitlines()[-1] == token
