"""Clean shutdown (issue #19, item 7) with real node processes, real HTTP and real mDNS.

SIGINT / SIGTERM: new requests get a 503, requests in flight may finish within
``--shutdown-grace``, the rest end in-band (an error chunk and ``[DONE]``, or an error
JSON), the stages the coordinator placed on peers are stopped, the mDNS record is
withdrawn, and the process exits with status 0 within the grace plus 2 s, with no
traceback in its log. A second signal exits at once (128 + the signal).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from meshnode.bench.cluster import link_model
from tests.nodeproc import lo_multicast, meshnode_cmd, start_node, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.net]

ROOT = Path(__file__).resolve().parents[1]
NODE_FLAGS = ("--threads", "1", "--ctx", "1024", "--batch", "64", "--spec-mode", "off")
STORY = "Tell a long story about a dragon who learns to bake bread."
SHORT = "What is the capital of France? Answer in one sentence."


class Stream:
    """One streaming chat request on its own thread: the SSE data lines as they arrive."""

    def __init__(self, port: int, model: str, prompt: str, max_tokens: int, *, stream: bool = True) -> None:
        self.lines: list[str] = []
        self.status: int | None = None
        self.body: dict | None = None
        self.error: BaseException | None = None
        self._req = dict(model=model, stream=stream, max_tokens=max_tokens, temperature=0,
                         messages=[{"role": "user", "content": prompt}])
        self._url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self._url, json=self._req, timeout=60) as r:
                self.status = r.status_code
                if not self._req["stream"]:
                    self.body = json.loads(r.read())
                    return
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[len("data: "):])
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.error = exc

    def join(self, timeout: float = 15.0) -> "Stream":
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the client is still waiting"
        assert self.error is None, f"the stream broke: {self.error!r}"
        return self

    @property
    def chunks(self) -> list[dict]:
        return [json.loads(x) for x in self.lines if x != "[DONE]"]

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in self.chunks
                       if c.get("choices"))

    def content_chunks(self) -> int:
        return sum(1 for c in self.chunks if c.get("choices") and c["choices"][0]["delta"].get("content"))


def _single_node(tmp_path: Path, smollm2, *extra: str):
    home = tmp_path / "solo"
    link_model(home, smollm2.path)
    node = start_node(home, "solo", "--model", str(smollm2.path), *NODE_FLAGS, *extra).wait_up(30)
    node.wait_model(120)
    model = node.get("/v1/models")["data"][0]["id"]
    return node, model


def _post(port: int, model: str, prompt: str, max_tokens: int) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                      json=dict(model=model, max_tokens=max_tokens, temperature=0,
                                messages=[{"role": "user", "content": prompt}]))


def _exit_time(node, timeout: float = 15.0) -> float:
    """Seconds from now until the node's process exits."""
    t0 = time.monotonic()
    node.proc.wait(timeout)
    return time.monotonic() - t0


def _assert_clean_log(node) -> None:
    log = node.log()
    assert "Traceback" not in log, log[-4000:]
    assert "CancelledError" not in log, log[-4000:]


def test_sigterm_lets_a_stream_finish_within_the_grace(smollm2, tmp_path):
    node, model = _single_node(tmp_path, smollm2, "--shutdown-grace", "20")
    try:
        reference = _post(node.http_port, model, SHORT, 40).json()["choices"][0]["message"]["content"]
        s = Stream(node.http_port, model, SHORT, 40)
        wait_for(lambda: s.content_chunks() >= 1, 30, 0.005)
        node.proc.send_signal(signal.SIGTERM)
        took = _exit_time(node, 30)
        s.join()
        assert s.lines[-1] == "[DONE]"
        assert s.chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length"), s.chunks[-1]
        assert not any("error" in c for c in s.chunks)
        assert s.text == reference                  # the whole answer, not a cut one
        assert node.proc.returncode == 0
        assert took < 20, took
        _assert_clean_log(node)
    finally:
        node.stop()


def test_sigterm_ends_what_outlasts_the_grace_in_band(smollm2, tmp_path):
    """A long stream and a long non-streaming request outlast a 1.5 s grace; a request
    sent during the grace is refused with a 503."""
    grace = 1.5
    node, model = _single_node(tmp_path, smollm2, "--shutdown-grace", str(grace))
    try:
        s = Stream(node.http_port, model, STORY, 900)
        plain = Stream(node.http_port, model, STORY, 900, stream=False)
        wait_for(lambda: s.content_chunks() >= 3, 30, 0.005)
        t0 = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = _post(node.http_port, model, SHORT, 8)
        assert late.status_code == 503, late.text
        assert "shutting down" in late.json()["error"]["message"]
        node.proc.wait(15)
        took = time.monotonic() - t0
        s.join()
        plain.join()
        # the stream: its text so far, then one error chunk, then [DONE]
        assert s.content_chunks() >= 3
        assert s.lines[-1] == "[DONE]", s.lines[-3:]
        last = json.loads(s.lines[-2])
        assert "error" in last and "shutting down" in last["error"]["message"], last
        # the non-streaming request: an OpenAI error, not a dropped connection
        assert plain.status == 503 and "shutting down" in plain.body["error"]["message"], plain.body
        assert node.proc.returncode == 0
        assert grace <= took < grace + 2.0, took
        _assert_clean_log(node)
        assert not (node.home / "state" / "node.json").exists()
    finally:
        node.stop()


def test_a_second_signal_exits_at_once(smollm2, tmp_path):
    node, model = _single_node(tmp_path, smollm2, "--shutdown-grace", "60")
    try:
        s = Stream(node.http_port, model, STORY, 900)
        wait_for(lambda: s.content_chunks() >= 3, 30, 0.005)
        node.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert node.proc.poll() is None     # still draining: the grace is long
        node.proc.send_signal(signal.SIGTERM)
        took = _exit_time(node, 10)
        assert took < 1.0, took
        assert node.proc.returncode == 128 + signal.SIGTERM
        assert "Traceback" not in node.log()
    finally:
        node.stop()


def _same_mesh(homes: list[Path]) -> None:
    tok = meshnode_cmd("invite", "--home", str(homes[0])).stdout.strip().splitlines()[-1]
    for h in homes[1:]:
        r = meshnode_cmd("join", tok, "--home", str(h))
        assert r.returncode == 0, r.stderr


def _split(smollm2, tmp_path: Path, *coord_flags: str, peer_flags: tuple[str, ...] = ()):
    """A coordinator and a peer serving its second stage (found over mDNS on lo)."""
    if not lo_multicast():
        pytest.skip("multicast is off on lo (ip link set lo multicast on)")
    homes = [tmp_path / "coord", tmp_path / "peer"]
    for h in homes:
        link_model(h, smollm2.path)
    _same_mesh(homes)
    peer = start_node(homes[1], "peer", "--no-model", *peer_flags, *NODE_FLAGS).wait_up(30)
    try:
        coord = start_node(homes[0], "coord", "--model", str(smollm2.path), "--split", "2",
                           *coord_flags, *NODE_FLAGS).wait_up(30)
    except BaseException:
        peer.stop()
        raise
    try:
        coord.wait_model(120)
        assert [s["state"] for s in peer.status()["stages"]] == ["ready"]
    except BaseException:
        for n in (coord, peer):
            n.stop()
        raise
    return coord, peer, coord.get("/v1/models")["data"][0]["id"]


def test_split_coordinator_shutdown_stops_the_peer_stage_and_withdraws_mdns(smollm2, tmp_path):
    coord, peer, model = _split(smollm2, tmp_path, "--shutdown-grace", "1")
    try:
        s = Stream(coord.http_port, model, STORY, 900)
        wait_for(lambda: s.content_chunks() >= 3, 30, 0.005)
        coord.proc.send_signal(signal.SIGTERM)
        took = _exit_time(coord, 15)
        exited = time.monotonic()
        s.join()
        assert s.lines[-1] == "[DONE]" and "error" in json.loads(s.lines[-2])
        assert coord.proc.returncode == 0 and took < 3.0, took
        _assert_clean_log(coord)
        # the peer freed its stage: Stop came before the coordinator left (a lost link
        # would show the stage "failed", coordinator lost)
        stages = peer.status()["stages"]
        assert all(st["state"] == "stopped" for st in stages), stages
        assert "freeing the stage engine" in peer.log()
        # the mDNS record was withdrawn (goodbye packets), not left to expire
        withdrawn = f"mDNS: {coord.node_id}._meshnode._udp.local. withdrawn"
        wait_for(lambda: withdrawn in peer.log(), 2.0)
        assert time.monotonic() - exited < 2.0
    finally:
        for n in (coord, peer):
            n.stop()


def test_a_peer_that_stops_lets_the_answers_through_it_finish(smollm2, tmp_path):
    """SIGTERM to the node serving stage 1: it waits (its default grace) until the
    coordinator's request through it has finished, then leaves."""
    coord, peer, model = _split(smollm2, tmp_path)
    try:
        reference = _post(coord.http_port, model, SHORT, 40).json()["choices"][0]["message"]["content"]
        s = Stream(coord.http_port, model, SHORT, 40)
        wait_for(lambda: s.content_chunks() >= 1, 30, 0.005)
        peer.proc.send_signal(signal.SIGTERM)
        s.join(30)
        assert s.lines[-1] == "[DONE]" and not any("error" in c for c in s.chunks), s.lines[-3:]
        assert s.text == reference
        peer.proc.wait(10)
        assert peer.proc.returncode == 0
        _assert_clean_log(peer)
    finally:
        for n in (coord, peer):
            n.stop()


def test_a_peer_does_not_wait_for_sessions_kept_for_prefix_reuse(smollm2, tmp_path):
    """After an answer the coordinator keeps its session (prefix reuse) on both stages;
    a peer told to stop with a long grace leaves at once: no request is in flight."""
    coord, peer, model = _split(smollm2, tmp_path, peer_flags=("--shutdown-grace", "30"))
    try:
        _post(coord.http_port, model, SHORT, 8)
        assert peer.status()["stage_sessions"], "the coordinator keeps the session on the peer"
        peer.proc.send_signal(signal.SIGTERM)
        took = _exit_time(peer, 30)
        assert peer.proc.returncode == 0 and took < 5.0, took
        _assert_clean_log(peer)
    finally:
        for n in (coord, peer):
            n.stop()


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_the_tui_stops_cleanly_on_sigterm(tmp_path):
    """`meshnode run` (the TUI) in a real terminal: SIGTERM stops the node as q does."""
    home = tmp_path / "home"
    done = tmp_path / "exit-code"
    session = f"meshnode-test-{uuid.uuid4().hex[:8]}"
    cmd = (f"cd {ROOT} && MESHNODE_KEYRING=file {sys.executable} -m meshnode run --home {home} "
           f"--no-model --port 0 --interface 127.0.0.1 --no-discovery; echo $? > {done}; sleep 30")
    _tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "24", cmd)
    runtime = home / "state" / "node.json"
    try:
        wait_for(runtime.exists, 60, 0.1)
        pid = json.loads(runtime.read_text())["pid"]
        time.sleep(0.5)
        t0 = time.monotonic()
        import os

        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: done.exists() and done.read_text().strip() != "", 10, 0.05)
        assert time.monotonic() - t0 < 5.0
        assert done.read_text().strip() == "0"
        assert not runtime.exists()
        log = (home / "state" / "meshnode.log").read_text()
        assert "Traceback" not in log, log[-3000:]
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
