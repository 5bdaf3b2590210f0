"""A stage's Load waits for a link to the next stage's node (stage_server.wait_for_peer).

A node that just came back may be linked to the coordinator (which then plans with it)
before it is to the stage upstream of it; a step forwarded then was dropped and its
request waited out the 60 s reply timeout (seen in a CI run of test_failover's rejoin).
"""

from __future__ import annotations

import asyncio
import time

from meshnode.mesh.stage_server import wait_for_peer
from meshnode.state import PeerInfo


class _Fabric:
    def __init__(self, linked_after_s: float | None) -> None:
        self.t0 = time.monotonic()
        self.after = linked_after_s

    def peers(self) -> list[PeerInfo]:
        if self.after is None or time.monotonic() - self.t0 < self.after:
            return []
        return [PeerInfo("c", "c", "127.0.0.1:1", None, True)]


def test_a_load_waits_for_the_link_to_come():
    assert asyncio.run(wait_for_peer(_Fabric(0.0), "c", 1.0, poll_s=0.01))
    t0 = time.monotonic()
    assert asyncio.run(wait_for_peer(_Fabric(0.2), "c", 2.0, poll_s=0.01))
    assert 0.2 <= time.monotonic() - t0 < 1.5


def test_and_gives_up_after_its_bound():
    t0 = time.monotonic()
    assert not asyncio.run(wait_for_peer(_Fabric(None), "c", 0.2, poll_s=0.01))
    assert 0.2 <= time.monotonic() - t0 < 1.0
    assert not asyncio.run(wait_for_peer(_Fabric(0.0), "d", 0.05, poll_s=0.01))   # another node
