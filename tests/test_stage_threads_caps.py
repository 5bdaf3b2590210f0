"""The CPU threads of the stage a node serves for a peer travel in its capabilities, so
the coordinator's status and stage map show them (a peer's engine adapts its count to
its machine's free cores: meshnode/engine/threads.py)."""

from __future__ import annotations

import pytest

from meshnode.net.auth import check_capabilities
from meshnode.net.caps import from_dict, to_dict
from meshnode.state import Capabilities


def test_the_threads_round_trip_and_an_older_peer_reads_as_unknown():
    assert from_dict(to_dict(Capabilities(1 << 30, stage_threads=(1, 4)))).stage_threads == (1, 4)
    assert from_dict({"free_ram": 1}).stage_threads == (0, 0)


@pytest.mark.parametrize("bad", [[3, 2], [1], [1, 2, 3], [-1, 2], [1, 5000], ["1", "2"], [True, 2], 4, None])
def test_bad_threads_are_refused_at_authentication_and_read_as_unknown(bad):
    assert check_capabilities({"free_ram": 1, "stage_threads": [1, 2]}) is None
    if not (isinstance(bad, list) and len(bad) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                           and 0 <= x <= 4096 for x in bad)):
        assert "bad stage_threads" in check_capabilities({"free_ram": 1, "stage_threads": bad})
    assert from_dict({"free_ram": 1, "stage_threads": bad}).stage_threads == (0, 0)


async def test_a_thread_count_change_is_advertised_within_seconds(monkeypatch):
    """The node re-sends its capabilities soon after its served stage's thread count
    moves (not only every CAPS_REFRESH_S), and not while it stays put."""
    import asyncio
    from types import SimpleNamespace

    from meshnode import node as node_mod

    monkeypatch.setattr(node_mod, "THREADS_CHECK_S", 0.01)
    monkeypatch.setattr(node_mod, "CAPS_REFRESH_S", 3600.0)
    threads = [(2, 2)]
    sent: list[tuple[int, int]] = []

    async def advertise():
        sent.append(threads[0])

    fake = SimpleNamespace(stage_server=SimpleNamespace(served_threads=lambda: threads[0]), _advertise=advertise)
    task = asyncio.get_running_loop().create_task(node_mod.Node._refresh_caps(fake))
    try:
        await asyncio.sleep(0.1)
        assert sent == []                      # nothing moved: nothing sent
        threads[0] = (1, 2)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if sent:
                break
        assert sent == [(1, 2)]
        await asyncio.sleep(0.1)
        assert sent == [(1, 2)]                # once per change
    finally:
        task.cancel()
