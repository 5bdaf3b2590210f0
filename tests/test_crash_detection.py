"""A crashed peer on a host that stays up is dropped from the kernel's ICMP "port
unreachable" (meshnode.net.icmp), well before the 1.5 s of silence that notices a pulled
cable; a forged hint never drops a live peer. Real node processes, real UDP, real ICMP
from this host's kernel (tests/test_failure_detection.py covers silence, through a relay
that never answers with ICMP)."""

from __future__ import annotations

import signal
import time

import pytest

from tests.nodeproc import meshnode_cmd, start_node, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def pair(tmp_path):
    ha, hb = tmp_path / "a", tmp_path / "b"
    tok = meshnode_cmd("invite", "--home", str(ha)).stdout.strip().splitlines()[-1]
    assert meshnode_cmd("join", tok, "--home", str(hb)).returncode == 0
    b = start_node(hb, "b", "--no-model", "--no-discovery").wait_up(60)
    a = start_node(ha, "a", "--no-model", "--no-discovery", "--peer", f"127.0.0.1:{b.quic_port}",
                   "--log-level", "debug").wait_up(60)
    try:
        wait_for(lambda: a.peer_names() == {"b"} and b.peer_names() == {"a"}, 20)
        yield a, b
    except BaseException:
        for n in (a, b):
            print(f"--- {n.name}\n{n.log()[-4000:]}")
        raise
    finally:
        for n in (a, b):
            if n.proc.poll() is None:
                n.stop()


def test_a_killed_peer_is_dropped_on_port_unreachable(pair):
    a, b = pair
    t0 = time.monotonic()
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait()
    wait_for(lambda: "b" not in a.peer_names(), 5, 0.02)
    took = time.monotonic() - t0
    print(f"\nkill -9 of a peer: dropped after {took:.2f} s")
    assert f"peer {b.node_id} lost: peer vanished (port unreachable)" in a.log(), a.log()[-3000:]
