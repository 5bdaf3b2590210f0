"""Helpers to run real `meshnode` processes in tests (each with its own --home).

``meshnode_cmd(*args)`` runs the CLI in a subprocess. Until every command module listed
in ``meshnode.cli.COMMAND_MODULES`` exists in the tree (other packages land
concurrently), the launcher skips the missing ones so these tests run on their own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_LAUNCHER = (
    "import importlib.util, sys, meshnode.cli as c;"
    "c.COMMAND_MODULES = tuple(m for m in c.COMMAND_MODULES"
    " if importlib.util.find_spec('meshnode.cli.' + m));"
    "sys.exit(c.main(sys.argv[1:]))"
)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["MESHNODE_KEYRING"] = "file"
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("MESHNODE_HOME", None)
    return e


def meshnode_argv(*args: str) -> list[str]:
    return [sys.executable, "-c", _LAUNCHER, *args]


def meshnode_cmd(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run(meshnode_argv(*args), env=env(), capture_output=True, text=True, timeout=timeout)


@dataclass
class NodeProc:
    home: Path
    name: str
    proc: subprocess.Popen
    log_path: Path
    info: dict = field(default_factory=dict)

    @property
    def node_id(self) -> str:
        return self.info["node_id"]

    @property
    def quic_port(self) -> int:
        return self.info["quic_port"]

    def wait_up(self, timeout: float = 15.0) -> "NodeProc":
        rt = self.home / "state" / "node.json"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node {self.name} exited {self.proc.returncode}:\n{self.log()}")
            if rt.exists():
                try:
                    self.info = json.loads(rt.read_text())
                    self.get("/health")
                    return self
                except (ValueError, OSError):
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"node {self.name} did not come up:\n{self.log()}")

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.info['http_port']}{path}", timeout=5) as r:
            return json.loads(r.read())

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


def start_node(home: Path, name: str, *extra: str) -> NodeProc:
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "node.log"
    f = open(log_path, "wb")
    proc = subprocess.Popen(
        meshnode_argv("serve", "--headless", "--home", str(home), "--port", "0",
                      "--interface", "127.0.0.1", "--name", name, "--log-level", "debug", *extra),
        env=env(), stdout=f, stderr=subprocess.STDOUT,
    )
    f.close()
    return NodeProc(home, name, proc, log_path)


def wait_for(pred, timeout: float, interval: float = 0.05) -> float:
    """Poll ``pred()`` until true; returns the seconds it took (raises on timeout)."""
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(interval)
