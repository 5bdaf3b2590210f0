"""Helpers to run real `meshnode` processes in tests (each with its own --home).

``meshnode_cmd(*args)`` runs the CLI in a subprocess; ``start_node`` starts a headless
node whose :class:`NodeProc` extends the benchmarks' :class:`~meshnode.bench.cluster.LocalNode`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from meshnode.bench.cluster import LocalNode

ROOT = Path(__file__).resolve().parents[1]

def lo_multicast() -> bool:
    """Whether multicast is on on the loopback interface (mDNS between nodes on one
    machine needs it): the MULTICAST flag `ip link show lo` prints, read from sysfs."""
    try:
        return bool(int(Path("/sys/class/net/lo/flags").read_text(), 16) & 0x1000)   # IFF_MULTICAST
    except (OSError, ValueError):
        return False


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["MESHNODE_KEYRING"] = "file"
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("MESHNODE_HOME", None)
    return e


def meshnode_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshnode", *args]


def meshnode_cmd(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run(meshnode_argv(*args), env=env(), capture_output=True, text=True, timeout=timeout)


class NodeProc(LocalNode):
    """A node process of a test: :class:`meshnode.bench.cluster.LocalNode` plus helpers."""

    @property
    def node_id(self) -> str:
        return self.info["node_id"]

    @property
    def quic_port(self) -> int:
        return self.info["quic_port"]

    def wait_up(self, timeout: float = 15.0) -> "NodeProc":
        super().wait_up(timeout)
        return self

    def status(self) -> dict:
        return self.get("/status")

    def peer_names(self) -> set[str]:
        return {p["name"] for p in self.status()["peers"]}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _serve_argv(home: Path, name: str, interface: str, extra: tuple[str, ...]) -> list[str]:
    return meshnode_argv("serve", "--headless", "--home", str(home), "--port", "0",
                         "--interface", interface, "--name", name, "--log-level", "debug", *extra)


def start_node(home: Path, name: str, *extra: str) -> NodeProc:
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "node.log"
    f = open(log_path, "wb")
    proc = subprocess.Popen(_serve_argv(home, name, "127.0.0.1", extra),
                            env=env(), stdout=f, stderr=subprocess.STDOUT)
    f.close()
    return NodeProc(name=name, home=home, proc=proc, log_path=log_path)


class NetnsNodeProc(NodeProc):
    """A node in namespace ``index`` of a :class:`meshnode.bench.netns.Netns`: its HTTP
    endpoint is on that namespace's loopback, so requests to it are made from inside."""

    netns = None   # the Netns
    index = 0

    def get(self, path: str) -> dict:
        with self.netns.inside(self.index):
            return super().get(path)

    @contextlib.contextmanager
    def inside(self):
        """The calling thread in this node's namespace (for an HTTP client of its own)."""
        with self.netns.inside(self.index):
            yield


def start_node_in(net, index: int, home: Path, name: str, *extra: str) -> NetnsNodeProc:
    """:func:`start_node` inside namespace ``index`` of ``net``, announcing (mDNS) and
    reachable (QUIC) at that namespace's own address."""
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "node.log"
    with open(log_path, "wb") as f:
        proc = net.popen(index, _serve_argv(home, name, net.ip(index), extra),
                         env=env(), stdout=f, stderr=subprocess.STDOUT)
    node = NetnsNodeProc(name=name, home=home, proc=proc, log_path=log_path)
    node.netns, node.index = net, index
    return node


def wait_for(pred, timeout: float, interval: float = 0.05) -> float:
    """Poll ``pred()`` until true; returns the seconds it took (raises on timeout)."""
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(interval)


async def until(pred, timeout: float, interval: float = 0.02) -> None:
    """:func:`wait_for` inside an event loop: poll ``pred()`` without blocking the loop."""
    import asyncio

    for _ in range(int(timeout / interval)):
        if pred():
            return
        await asyncio.sleep(interval)
    raise TimeoutError(f"condition not met within {timeout} s")


class TwoStageSplit:
    """A 2-stage split on loopback: stage 1 (a ``--no-model`` node, up for the whole
    module) and a coordinator restarted per configuration with :meth:`start`. Both run
    ``node_flags``; the coordinator serves its own hard link of the model, so files
    written beside it (a model package) concern one test module only."""

    def __init__(self, root: Path, model: Path, node_flags: tuple[str, ...]) -> None:
        from meshnode.bench.cluster import free_udp_port, link_model

        self.node_flags = node_flags
        self.homes = [root / "n0", root / "n1"]
        self.model = link_model(self.homes[0], model)
        link_model(self.homes[1], model)
        tok = meshnode_cmd("invite", "--home", str(self.homes[0])).stdout.strip().splitlines()[-1]
        r = meshnode_cmd("join", tok, "--home", str(self.homes[1]))
        assert r.returncode == 0, r.stderr
        self.quic_port = free_udp_port()
        self.stage1 = start_node(self.homes[1], "n1", "--no-model", "--no-discovery",
                                 "--quic-port", str(self.quic_port), *node_flags).wait_up(30)
        self.coord: NodeProc | None = None

    def start(self, *flags: str) -> NodeProc:
        """(Re)start the coordinator with ``flags``; return it once its model is ready."""
        self.stop_coordinator()
        self.coord = start_node(self.homes[0], "n0", "--model", str(self.model), "--split", "2",
                                "--no-discovery", "--peer", f"127.0.0.1:{self.quic_port}",
                                *self.node_flags, *flags).wait_up(30)

        def ready() -> bool:
            model = self.coord.get("/health").get("model") or {}
            if model.get("state") == "failed":
                raise AssertionError(f"model failed: {model}\n{self.coord.log()[-3000:]}")
            return model.get("state") == "ready"

        try:
            wait_for(ready, 180, interval=0.25)
            stages = self.coord.status()["stages"]
            assert [s["state"] for s in stages] == ["ready", "ready"], stages
        except BaseException:
            print(self.coord.log()[-4000:])
            raise
        return self.coord

    def chats(self, conversations, max_tokens: int, **params) -> list[tuple[str, dict]]:
        """Greedy answers to ``conversations`` (lists of messages), one after another as
        one client: (text, timings) each. ``params``: more request fields."""
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{self.coord.info['http_port']}/v1",
                        api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        out = []
        for messages in conversations:
            r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                               temperature=0, **params)
            timings = (r.model_extra or {}).get("timings") or {}
            # usage states the reused prompt tokens as OpenAI does; timings, as llama.cpp does
            assert r.usage.prompt_tokens_details.cached_tokens == timings.get("cache_n", 0), (r.usage, timings)
            out.append((r.choices[0].message.content, timings))
        return out

    def stop_coordinator(self) -> None:
        if self.coord is not None:
            self.coord.stop()
            self.coord = None

    def close(self) -> None:
        self.stop_coordinator()
        self.stage1.stop()

    def __enter__(self) -> "TwoStageSplit":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
