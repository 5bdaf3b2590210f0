"""Failure detection without false alarms: two real node processes serving a 2-stage
SmolLM2 split whose link runs through a delaying UDP relay (a process of its own) that
stalls the link for 200 ms every second, the whole time. Under a long prefill on the
stage, maximum-size HTTP bodies on the coordinator and every core busy, neither node
may drop the other; a killed stage is dropped within 2 s. (The pulled cable is
tests/test_netns.py::test_link_down_is_detected_by_the_peer.)

Each test prints the longest silence either node's dead-peer watch saw (the link logs
each new record at debug level), against ``dead_after_s``."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from meshnode.bench.cluster import link_model
from meshnode.net.link import LinkSettings
from meshnode.serve.http_guard import DEFAULT_MAX_BODY
from tests.nodeproc import env, meshnode_cmd, start_node, wait_for

pytestmark = pytest.mark.slow

SPIKE_EVERY_S, SPIKE_MS = 1.0, 200
FLAGS = ("--no-discovery", "--ctx", "4096", "--batch", "2048", "--parallel", "2", "--threads", "2")
_RECORD = re.compile(r"longest silence so far ([0-9.]+) s")
_LOST = re.compile(r"peer \w+ lost: .*|silent for .*|idle timeout")


class _Relay:
    """``python -m meshnode.bench.relay`` in a process of its own."""

    def __init__(self, target_port: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshnode.bench.relay", "--target", f"127.0.0.1:{target_port}",
             "--delay-ms", "0.5", "--spike-every", str(SPIKE_EVERY_S), "--spike-ms", str(SPIKE_MS)],
            env=env(), stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("listening on "), line
        self.port = int(line.rsplit(":", 1)[1])

    def stop(self) -> dict:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=10)
        return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def split(smollm2, tmp_path_factory):
    """Node ``a`` coordinates the model split in 2 and reaches ``b`` (stage 1) only through
    the spiking relay. Yields ``(a, b, relay, model_id)``."""
    root = tmp_path_factory.mktemp("detect")
    ha, hb = root / "a", root / "b"
    for h in (ha, hb):
        link_model(h, smollm2.path)
    tok = meshnode_cmd("invite", "--home", str(ha)).stdout.strip().splitlines()[-1]
    assert meshnode_cmd("join", tok, "--home", str(hb)).returncode == 0
    b = start_node(hb, "b", "--no-model", *FLAGS).wait_up(60)
    relay = _Relay(b.quic_port)
    a = start_node(ha, "a", "--peer", f"127.0.0.1:{relay.port}", "--model", str(smollm2.path),
                   "--split", "2", *FLAGS)
    try:
        a.wait_up(60).wait_model(180)
        assert [s["node_id"] for s in a.status()["stages"]] == [a.node_id, b.node_id]
        yield a, b, relay, a.get("/v1/models")["data"][0]["id"]
    except BaseException:
        for n in (a, b):
            print(f"--- {n.name}\n{n.log()[-4000:]}")
        raise
    finally:
        a.stop()
        b.stop()
        if relay.proc.poll() is None:
            print(f"relay: {relay.stop()}")


class _Watch:
    """What both nodes logged from now on: losses and the longest silence seen."""

    def __init__(self, *nodes) -> None:
        self.nodes = nodes
        self.start = {n.name: len(n.log()) for n in nodes}

    def new(self, n) -> str:
        return n.log()[self.start[n.name]:]

    def lost(self) -> list[str]:
        return [f"{n.name}: {m}" for n in self.nodes for m in _LOST.findall(self.new(n))]

    def longest_silence(self) -> float:
        return max([float(x) for n in self.nodes for x in _RECORD.findall(n.log())], default=0.0)

    def check(self, what: str) -> None:
        print(f"\n{what}: longest silence either node saw so far {self.longest_silence():.2f} s "
              f"(dropped after {LinkSettings().dead_after_s} s)")
        assert self.lost() == [], self.lost()
        for n in self.nodes:
            assert n.proc.poll() is None


def _post(a, body: bytes, timeout: float = 300) -> tuple[int, bytes]:
    req = urllib.request.Request(a.base_url + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _chat(a, model: str, content: str, max_tokens: int) -> dict:
    st, body = _post(a, json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                                    "max_tokens": max_tokens, "temperature": 0}).encode())
    assert st == 200, body[:300]
    return json.loads(body)


def test_no_false_detection_with_200ms_spikes(split):
    a, b, relay, model = split
    watch = _Watch(a, b)
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < 15:             # decode traffic through 15 stalls
        _chat(a, model, "Count from one to twenty.", 8)
        n += 1
    watch.check(f"15 s of 200 ms stalls every {SPIKE_EVERY_S:g} s, {n} requests")


def test_no_false_detection_during_a_long_prefill_on_the_stage(split):
    a, b, relay, model = split
    watch = _Watch(a, b)
    # ~2,300 tokens, one chunk (--batch 2048 plus one): each stage's engine is busy in
    # llama_decode for seconds while its event loop must keep the heartbeats going
    prompt = " ".join(f"item {i} weighs {i * 7 % 113} grams." for i in range(260))
    t0 = time.monotonic()
    out = _chat(a, model, prompt, 2)
    took = time.monotonic() - t0
    assert out["usage"]["prompt_tokens"] > 2048
    watch.check(f"prefill of {out['usage']['prompt_tokens']} tokens across the split in {took:.1f} s")


def test_no_false_detection_while_max_size_bodies_are_parsed(split):
    a, b, relay, model = split
    watch = _Watch(a, b)
    head = json.dumps({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": ""}]})
    fill = DEFAULT_MAX_BODY - len(head)
    body = head.replace('"content": ""', '"content": "' + "hi " * (fill // 3) + '"').encode()
    assert DEFAULT_MAX_BODY - 3 <= len(body) <= DEFAULT_MAX_BODY
    t0 = time.monotonic()
    codes = [_post(a, body)[0] for _ in range(3)]   # parsed, validated, tokenized: too long
    assert codes == [400] * 3, codes
    watch.check(f"3 bodies of {len(body)} bytes in {time.monotonic() - t0:.1f} s")


def test_no_false_detection_with_every_core_busy(split):
    import os

    a, b, relay, model = split
    watch = _Watch(a, b)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            _chat(a, model, "Name three colours.", 8)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    watch.check(f"10 s with {len(hogs)} busy loops on {os.cpu_count()} cores")


def test_a_killed_stage_is_dropped_within_2s(split):
    a, b, relay, model = split
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait()
    took = wait_for(lambda: not any(p["node_id"] == b.node_id for p in a.status()["peers"]), 5, 0.02)
    counters = relay.stop()
    print(f"\nkill -9 of the stage: dropped after {took:.2f} s; relay {counters}")
    assert counters["spiked"] > 0
    assert took < 2.0
