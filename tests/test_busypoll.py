"""Busy polling (meshnode/net/busypoll.py): the selector spins only while messages flow,
the spin (in C, without the GIL) starves no other thread, the option resolves as
documented, and a split whose nodes busy-poll gives the one-node greedy text."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import threading
import time
import urllib.request

import pytest

from meshnode.cli.run import loop_factory
from meshnode.net import busypoll
from meshnode.net.busypoll import BusyPollSelector, busy_poll_loop_factory


@pytest.fixture(scope="module")
def spin():
    fn = busypoll._spinner()
    if fn is None:
        pytest.skip("no C compiler: busy polling is unavailable here (the node logs it and sleeps)")
    return fn


class _Recorder:
    """A spinner that records what it was asked and reports nothing ready."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, fd: int, ns: int) -> int:
        self.calls.append(ns)
        return 0


def test_a_selector_spins_only_within_the_window_after_something_was_ready():
    rec = _Recorder()
    a, b = socket.socketpair()
    with a, b, BusyPollSelector(0.2, rec) as sel:
        sel.register(a, 1)                    # EVENT_READ
        assert sel.select(0.01) == [] and rec.calls == []      # cold: an ordinary wait
        b.send(b"x")
        assert len(sel.select(0.01)) == 1 and rec.calls == []  # ready at once: no spin needed
        a.recv(1)
        assert sel.select(0.01) == []                           # hot: spun, for the timeout only
        assert len(rec.calls) == 1 and 0 < rec.calls[0] <= 10_000_000
        assert sel.select(0) == [] and len(rec.calls) == 1     # a poll (timeout 0) never spins
        time.sleep(0.25)
        assert sel.select(0.01) == [] and len(rec.calls) == 1  # the window has passed: asleep


def test_a_spin_returns_as_soon_as_something_is_ready(spin):
    a, b = socket.socketpair()
    with a, b, BusyPollSelector(10.0, spin) as sel:
        sel.register(a, 1)
        b.send(b"x")
        sel.select(0)                         # makes the selector hot
        a.recv(1)
        threading.Timer(0.05, b.send, (b"y",)).start()
        t0 = time.monotonic()
        ready = sel.select(5.0)
        assert len(ready) == 1 and sel.spins == 1
        assert time.monotonic() - t0 < 4.0    # not the timeout: the spin saw the byte


def test_the_spin_leaves_the_interpreter_to_other_threads(spin):
    # A spin in Python would hold the GIL (dropping and retaking it in a tight loop starves
    # every waiting thread); the C spin runs without it, so this thread's Python work
    # finishes while the selector is still spinning.
    a, b = socket.socketpair()
    done: list[float] = []

    def work() -> None:
        sum(i * i for i in range(200_000))
        done.append(time.monotonic())

    with a, b, BusyPollSelector(10.0, spin) as sel:
        sel.register(a, 1)
        b.send(b"x")
        sel.select(0)
        a.recv(1)
        t = threading.Thread(target=work)
        t.start()
        assert sel.select(3.0) == []          # spun for the whole timeout: nothing came
        end = time.monotonic()
        t.join()
    assert done and done[0] < end - 1.0


def test_a_busy_polling_loop_serves_datagrams(spin):
    factory = busy_poll_loop_factory(0.05)
    assert factory is not None and busy_poll_loop_factory(0.0) is None

    async def echo_round_trips(n: int) -> int:
        loop = asyncio.get_running_loop()
        assert isinstance(loop._selector, BusyPollSelector)   # type: ignore[attr-defined]
        got: asyncio.Queue[bytes] = asyncio.Queue()

        class Echo(asyncio.DatagramProtocol):
            def connection_made(self, transport):
                self.t = transport

            def datagram_received(self, data, addr):
                self.t.sendto(data, addr)

        class Client(asyncio.DatagramProtocol):
            def datagram_received(self, data, addr):
                got.put_nowait(data)

        server, _ = await loop.create_datagram_endpoint(Echo, local_addr=("127.0.0.1", 0))
        port = server.get_extra_info("sockname")[1]
        client, _ = await loop.create_datagram_endpoint(Client, remote_addr=("127.0.0.1", port))
        try:
            for i in range(n):
                client.sendto(str(i).encode())
                assert await asyncio.wait_for(got.get(), 5) == str(i).encode()
        finally:
            client.close()
            server.close()
        return loop._selector.spins                          # type: ignore[attr-defined]

    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(echo_round_trips(50)) > 0


def test_the_flag_over_the_config_over_off(monkeypatch):
    from meshnode.config import parse_config

    windows: list[float] = []
    monkeypatch.setattr(busypoll, "busy_poll_loop_factory", lambda w: windows.append(w))
    flag = lambda v: argparse.Namespace(busy_poll=v)   # noqa: E731
    none, on_file = parse_config(""), parse_config("[node]\nbusy_poll = true\n")
    loop_factory(flag(None), none)                             # default: off
    loop_factory(flag(True), none)
    loop_factory(flag(None), on_file)                          # the file
    loop_factory(flag(False), on_file)                         # --no-busy-poll wins
    on = busypoll.WINDOW_S
    assert windows == [0.0, on, on, 0.0]


def test_a_bad_busy_poll_value_is_one_line(tmp_path, meshnode_main):
    r = meshnode_main("--home", str(tmp_path), "serve", "--headless", "--busy-poll=yes")
    assert r.returncode == 2 and "--busy-poll" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "config").mkdir(exist_ok=True)
    (tmp_path / "config" / "config.toml").write_text('[node]\nbusy_poll = "yes"\n')
    r = meshnode_main("--home", str(tmp_path), "serve", "--headless", "--no-model")
    assert r.returncode != 0 and "node.busy_poll: expected true or false" in r.stderr
    assert "Traceback" not in r.stderr


def _completion(node, prompt: str, n: int) -> str:
    model = node.get("/v1/models")["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0}).encode()
    req = urllib.request.Request(node.base_url + "/completions", body, {"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=60) as r:
        out = json.loads(r.read())
    assert out["usage"]["completion_tokens"] == n
    return out["choices"][0]["text"]


@pytest.mark.slow
@pytest.mark.net
def test_a_split_of_busy_polling_nodes_gives_the_one_node_text(synthetic_gguf, spin):
    from meshnode.bench.cluster import LocalCluster

    path = synthetic_gguf(n_layer=4)
    common = ("--threads", "1", "--ctx", "256", "--parallel", "1")
    prompt = "The lighthouse keeper opened the bottle and read"
    with LocalCluster(path, 2) as cluster:
        alone = cluster.start(0, "--model", str(path), "--no-discovery", *common).wait_model()
        want = _completion(alone, prompt, 32)
        alone.stop()
        server = cluster.start(1, "--no-model", "--busy-poll", *common)
        coord = cluster.start(0, "--model", str(path), "--split", "2", "--busy-poll", *common).wait_model()
        assert [s["layers"] for s in coord.get("/status")["stages"]] == [[0, 2], [2, 4]]
        got = _completion(coord, prompt, 32)
        logs = coord.log_tail(200_000) + server.log_tail(200_000)
    assert got == want
    assert len(re.findall(r"busy polling: the event loop spins", logs)) == 2
