"""Nodes on their own addresses: real node processes in separate network namespaces
joined by a bridge (meshnode/bench/netns.py), each with its own IP, finding each other by
real mDNS across the bridge, a split served across them, `tc tbf` shaping and a pulled
cable. Needs root and iproute2 (CI runs as root); skipped with the reason otherwise."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from meshnode.bench.cluster import link_model
from meshnode.bench.errors import BenchError
from meshnode.bench.netns import PREFIX, Netns, namespaces, unavailable
from tests.nodeproc import meshnode_cmd, start_node, start_node_in, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.netns]

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "def fibonacci(n):\n    # complete this function\n",
]
MAX_TOKENS = 24
NODE_FLAGS = ("--threads", "1", "--ctx", "512", "--batch", "64", "--parallel", "2")


@pytest.fixture(scope="module")
def netns_ok() -> None:
    # Checked here, not at collection: the probe creates a namespace (a process), which
    # collecting the fast tier must not do.
    reason = unavailable()
    if reason:
        pytest.skip(reason)


def _complete_all(port: int) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    return [client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                           max_tokens=MAX_TOKENS, temperature=0).choices[0].message.content
            for p in PROMPTS]


def _authenticated(node, node_id: str) -> dict | None:
    return next((p for p in node.status()["peers"] if p["node_id"] == node_id and p["authenticated"]), None)


@pytest.fixture(scope="module")
def cluster(netns_ok, smollm2, tmp_path_factory):
    """Two namespaces; node ``a`` (ns 0) coordinates SmolLM2 split in 2 stages, node
    ``b`` (ns 1, ``--no-model``) holds the other stage. Yields ``(net, a, b, found_s)``."""
    root = tmp_path_factory.mktemp("netns")
    homes = [root / "a", root / "b"]
    for h in homes:
        link_model(h, smollm2.path)
    tok = meshnode_cmd("invite", "--home", str(homes[0])).stdout.strip().splitlines()[-1]
    assert meshnode_cmd("join", tok, "--home", str(homes[1])).returncode == 0
    with Netns(2) as net:
        b = start_node_in(net, 1, homes[1], "b", "--no-model", *NODE_FLAGS).wait_up(30)
        t0 = time.monotonic()
        a = start_node_in(net, 0, homes[0], "a", "--model", str(smollm2.path), "--split", "2",
                          *NODE_FLAGS).wait_up(30)
        try:
            wait_for(lambda: _authenticated(a, b.node_id) and _authenticated(b, a.node_id), 20)
            found_s = time.monotonic() - t0
            a.wait_model(120)
            yield net, a, b, found_s
        except BaseException:
            for n in (a, b):
                print(f"--- {n.name}\n{n.log()[-4000:]}")
            raise
        finally:
            a.stop()
            b.stop()


@pytest.fixture(scope="module")
def single_node_outputs(smollm2, tmp_path_factory) -> list[str]:
    """The reference: the same prompts on one node (whole model), on loopback."""
    home = tmp_path_factory.mktemp("solo") / "solo"
    link_model(home, smollm2.path)
    node = start_node(home, "solo", "--no-discovery", "--model", str(smollm2.path), *NODE_FLAGS)
    try:
        node.wait_up(30).wait_model(120)
        return _complete_all(node.http_port)
    finally:
        node.stop()


def test_nodes_find_each_other_by_mdns_at_their_own_addresses(cluster):
    net, a, b, found_s = cluster
    print(f"\nmDNS discovery + authentication across the bridge: {found_s:.2f} s after start")
    pa, pb = _authenticated(b, a.node_id), _authenticated(a, b.node_id)
    # each sees the other at its namespace's address, not at loopback
    assert pa["address"].rpartition(":")[0] == net.ip(0), pa
    assert pb["address"].rpartition(":")[0] == net.ip(1), pb
    assert a.status()["node"]["address"].startswith(net.ip(0) + ":")
    # each endpoint is on its own namespace's loopback, reached from inside it
    assert (a.get("/health")["node_id"], b.get("/health")["node_id"]) == (a.node_id, b.node_id)


def test_split_across_namespaces_equals_one_node(cluster, single_node_outputs):
    net, a, b, _ = cluster
    stages = a.status()["stages"]
    assert [s["state"] for s in stages] == ["ready", "ready"], stages
    assert [s["node_id"] for s in stages] == [a.node_id, b.node_id]
    with a.inside():
        outputs = _complete_all(a.http_port)
    assert outputs == single_node_outputs


def test_tbf_shaping_is_in_effect(cluster):
    net, a, b, _ = cluster
    free = net.tcp_rate(1, 0, 4_000_000)
    before = net.qdisc_stats(1)
    try:
        net.shape(1, "40mbit")
    except BenchError as exc:
        if "unknown" in str(exc):
            pytest.skip(f"this kernel has no tbf qdisc: {exc}")
        raise
    try:
        up = net.tcp_rate(1, 0, 2_000_000)        # b's uplink: its own tbf
        down = net.tcp_rate(0, 1, 2_000_000)      # b's downlink: the bridge side's tbf
        stats = net.qdisc_stats(1)
        # the mesh keeps working through the shaped link (heartbeats, status)
        assert _authenticated(a, b.node_id)
        net.shape(1, "1gbit")   # the line rate of issue #18's transfer target
        gbit = net.tcp_rate(1, 0, 40_000_000)
    finally:
        net.unshape(1)
    print(f"\nunshaped {free / 1e6:.0f} Mbit/s; shaped to 40 Mbit/s: up {up / 1e6:.1f}, "
          f"down {down / 1e6:.1f} Mbit/s; tbf sent {stats.sent_bytes} B, "
          f"overlimits {stats.overlimits}; shaped to 1 Gbit/s: one TCP stream {gbit / 1e6:.0f} Mbit/s")
    assert before.kind != "tbf" and stats.kind == "tbf"
    assert stats.sent_bytes >= 2_000_000 and stats.overlimits > 0
    for rate in (up, down):
        assert 25e6 < rate < 46e6, rate
    # the bucket lets one burst (10 ms of rate) through on top: 3 % of 40 MB
    assert free > 4 * 40e6 and gbit < 1.08e9


def test_link_down_is_detected_by_the_peer(cluster):
    """Pull b's cable: a drops b within 5 s (the dead-peer watch: dead_after_s of
    silence, docs/mesh.md "Failure detection"), and they meet again once it is back."""
    net, a, b, _ = cluster
    net.link_down(1)
    try:
        detect_s = wait_for(lambda: not _authenticated(a, b.node_id), 30, interval=0.05)
        other_side_s = wait_for(lambda: not _authenticated(b, a.node_id), 30, interval=0.05)
        stages = [(s["node"], s["state"]) for s in a.status()["stages"]]
    finally:
        net.link_up(1)
    back_s = wait_for(lambda: _authenticated(a, b.node_id) and _authenticated(b, a.node_id), 30, interval=0.1)
    print(f"\nlink down: a dropped b after {detect_s:.2f} s (b dropped a by {detect_s + other_side_s:.2f} s); "
          f"link up: linked again after {back_s:.2f} s; a's stages while b was cut off: {stages}")
    assert detect_s < 5
    assert detect_s + other_side_s < 5


def test_cleanup_leaves_no_namespace_behind(netns_ok):
    # a leftover of a run killed with SIGKILL: its pid is gone
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = f"{PREFIX}-{dead.pid}-0-0"
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    mine: list[str] = []
    with pytest.raises(RuntimeError, match="boom"):
        with Netns(2) as net:
            assert leftover not in namespaces()        # swept at start
            mine = [h.ns for h in net.hosts] + [net.hub]
            assert set(mine) <= set(namespaces())
            sleeper = net.popen(0, ["sleep", "60"])
            raise RuntimeError("boom")
    assert sleeper.poll() is not None                  # killed, not left running
    assert not set(mine) & set(namespaces())
    assert not Path(f"/run/netns/{mine[0]}").exists()
