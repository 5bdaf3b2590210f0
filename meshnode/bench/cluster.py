"""Local clusters of real `meshnode` processes for benchmarks.

Each node gets its own home under a temporary folder (identity, secret, store), the
model is hard-linked into every store (no copy of the bytes), all homes join one mesh,
and nodes talk over loopback: by mDNS, or — when a :class:`~meshnode.bench.relay.UdpDelayRelay`
emulates LAN latency — only through the relay (discovery off, the coordinator dials the
relay, which forwards to the stage node). With ``netns`` (a :class:`~meshnode.bench.netns.Netns`)
node ``i`` runs in namespace ``i`` at its own address on a bridge instead; its HTTP
endpoint is on that namespace's loopback, reached from inside (:meth:`LocalNode.inside`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from meshnode.bench.errors import BenchError


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("MESHNODE_KEYRING", "file")
    env.pop("MESHNODE_HOME", None)
    return env


def cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshnode", *args], env=_env(),
                          capture_output=True, text=True, timeout=timeout)


@dataclass
class LocalNode:
    name: str
    home: Path
    proc: subprocess.Popen
    log_path: Path
    info: dict = field(default_factory=dict)
    netns: object = None      # the Netns it runs in (None: this namespace)
    index: int = 0

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """The calling thread in this node's namespace (HTTP clients made here stay there)."""
        if self.netns is None:
            yield
        else:
            with self.netns.inside(self.index):
                yield

    def get(self, path: str) -> dict:
        with self.inside():
            return self._get(path)

    def _get(self, path: str) -> dict:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # loopback: no proxy
        with opener.open(f"http://127.0.0.1:{self.info['http_port']}{path}", timeout=5) as r:
            return json.loads(r.read())

    @property
    def http_port(self) -> int:
        return int(self.info["http_port"])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def wait_up(self, timeout: float = 60.0) -> "LocalNode":
        rt = self.home / "state" / "node.json"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"node {self.name} exited ({self.proc.returncode}):\n{self.log_tail()}")
            if rt.exists():
                try:
                    self.info = json.loads(rt.read_text())
                    self.get("/health")
                    return self
                except (ValueError, OSError):
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"node {self.name} did not come up:\n{self.log_tail()}")

    def wait_model(self, timeout: float = 300.0) -> "LocalNode":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            model = self.get("/health").get("model") or {}
            if model.get("state") == "ready":
                return self
            if model.get("state") == "failed":
                raise BenchError(f"model failed on {self.name}: {model.get('detail')}\n{self.log_tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"model not ready on {self.name}:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def add_busy_poll_option(p) -> None:
    """``--busy-poll`` of the benchmarks that start nodes (:func:`busy_poll_flags`)."""
    p.add_argument("--busy-poll", action="store_true",
                   help="every node busy-polls (meshnode serve --busy-poll; default: they sleep)")


def busy_poll_flags(args) -> tuple[str, ...]:
    return ("--busy-poll",) if args.busy_poll else ()


def cpu_flags(index: int, n_nodes: int, threads: int, *, pin: bool) -> tuple[str, ...]:
    """``--cpus`` for node ``index`` of ``n_nodes`` on this machine: its own ``threads``
    CPUs, when the machine has enough for every node (else none: leave it to the OS).

    Nodes of one split on one machine compute faster on cores of their own (the final
    stage's step 8.4 ms against 11.0 on the 2-core VM), but so does a pinned single
    node, and `bench serve`'s ratios did not move, so the benchmarks pin only when asked (``--pin``)."""
    import os

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not pin or n_nodes * threads > len(cpus):
        return ()
    mine = cpus[index * threads:(index + 1) * threads]
    return ("--cpus", ",".join(map(str, mine)))


class LocalCluster:
    """``with LocalCluster(model, n_nodes) as c: c.start(...)``; everything stops on exit."""

    def __init__(self, model: Path, n_nodes: int, *, root: Path | None = None, netns=None) -> None:
        self.model = Path(model)
        self.netns = netns
        self._tmp = None if root else tempfile.mkdtemp(prefix="meshnode-bench-")
        self.root = Path(root or self._tmp)
        self.homes = [self.root / f"node{i}" for i in range(n_nodes)]
        self.nodes: list[LocalNode] = []
        for h in self.homes:
            link_model(h, self.model)
        token = cli("invite", "--home", str(self.homes[0])).stdout.strip().splitlines()[-1]
        for h in self.homes[1:]:
            r = cli("join", token, "--home", str(h))
            if r.returncode != 0:
                raise BenchError(f"join failed: {r.stderr}")

    def start(self, index: int, *flags: str, log_level: str = "info",
              env: dict[str, str] | None = None) -> LocalNode:
        """Start node ``index`` (``env``: variables set for its process alone)."""
        home = self.homes[index]
        log_path = home / "node.log"
        net = self.netns
        argv = [sys.executable, "-m", "meshnode", "serve", "--headless", "--home", str(home),
                "--port", "0", "--interface", "127.0.0.1" if net is None else net.ip(index),
                "--name", f"node{index}", "--log-level", log_level, *flags]
        penv = {**_env(), **(env or {})}
        with open(log_path, "ab") as f:
            if net is None:
                proc = subprocess.Popen(argv, env=penv, stdout=f, stderr=subprocess.STDOUT)
            else:
                proc = net.popen(index, argv, env=penv, stdout=f, stderr=subprocess.STDOUT)
        node = LocalNode(f"node{index}", home, proc, log_path, netns=net, index=index)
        self.nodes.append(node)
        return node.wait_up()

    def stop_all(self) -> None:
        for n in reversed(self.nodes):
            n.stop()
        self.nodes.clear()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


def link_model(home: Path, model: Path) -> Path:
    """Put ``model`` (every part of a split model) into the store of the node home
    ``home`` (hard links: no copy of the bytes, a copy across file systems) and return
    its path there."""
    from meshnode.gguf_files import model_files
    from meshnode.models.index import store_name

    folder = home / "data" / "models" / store_name(model)
    folder.mkdir(parents=True, exist_ok=True)
    for f in model_files(model):
        dest = folder / f.name
        if not dest.exists():
            try:
                os.link(f, dest)
            except OSError:
                shutil.copy2(f, dest)
    return folder / model.name


def free_udp_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sse_chunks(response) -> Iterator[dict]:
    """The JSON chunks of a streamed OpenAI answer (an httpx streaming response), after
    checking its status; ``[DONE]`` and non-data lines are skipped."""
    if response.status_code != 200:
        response.read()
        raise BenchError(f"HTTP {response.status_code} from the node: {response.text[:300]}")
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])
