"""Failover with real node processes (real mDNS, QUIC, HTTP, llama.cpp on SmolLM2).

kill -9 of the node serving a non-coordinator stage during a long greedy stream: the
coordinator re-plans on the members that remain, the request replays its token history
on the new route and the stream completes with the text of an uninterrupted run (no
token lost or repeated), with speculation on and off. The model serves later requests
(on fewer stages when it must) and uses a member that comes back. With no route left,
the stream ends with an error chunk and [DONE] within 2 s of the detection.

Each test prints the time to resume (detection -> serving again) the coordinator measured.
Pure logic of the same path (fake pipelines): tests/test_failover_units.py.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from meshnode.bench.cluster import link_model
from tests.nodeproc import lo_multicast, meshnode_cmd, start_node, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.net]

NODE_FLAGS = ("--threads", "1", "--ctx", "1024", "--batch", "64")
STORY = "Tell a long story about a dragon who learns to bake bread."
MAX_TOKENS = 240


class Stream:
    """One streaming greedy chat request on its own thread: data lines with arrival times."""

    def __init__(self, port: int, model: str, max_tokens: int = MAX_TOKENS, **params) -> None:
        self.lines: list[tuple[float, str]] = []    # (unix time, data)
        self.error: BaseException | None = None
        self._req = dict(model=model, stream=True, max_tokens=max_tokens, temperature=0,
                         messages=[{"role": "user", "content": STORY}], **params)
        self._url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self._url, json=self._req, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append((time.time(), line[len("data: "):]))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.error = exc

    def join(self, timeout: float = 120.0) -> "Stream":
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the client is still waiting"
        assert self.error is None, f"the stream broke: {self.error!r}"
        return self

    @property
    def chunks(self) -> list[dict]:
        return [json.loads(x) for _, x in self.lines if x != "[DONE]"]

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in self.chunks if c.get("choices"))

    def content_chunks(self) -> int:
        return sum(1 for c in self.chunks if c.get("choices") and c["choices"][0]["delta"].get("content"))


def _mesh(smollm2, root: Path, names: list[str]) -> list[Path]:
    if not lo_multicast():
        pytest.skip("multicast is off on lo (ip link set lo multicast on)")
    homes = [root / n for n in names]
    for h in homes:
        link_model(h, smollm2.path)
    tok = meshnode_cmd("invite", "--home", str(homes[0])).stdout.strip().splitlines()[-1]
    for h in homes[1:]:
        r = meshnode_cmd("join", tok, "--home", str(h))
        assert r.returncode == 0, r.stderr
    return homes


def _cluster(smollm2, root: Path, names: list[str], *coord_flags: str):
    """Helpers first (--no-model), then the coordinator; returns (coord, {name: helper})."""
    homes = _mesh(smollm2, root, names)
    helpers = {n: start_node(h, n, "--no-model", *NODE_FLAGS) for h, n in zip(homes[1:], names[1:])}
    coord = None
    try:
        for h in helpers.values():
            h.wait_up(30)
        coord = start_node(homes[0], names[0], "--model", str(smollm2.path), *coord_flags, *NODE_FLAGS).wait_up(30)
        coord.wait_model(180)
    except BaseException:
        _stop_all(coord, *helpers.values())
        raise
    return coord, helpers


def _stop_all(*nodes) -> None:
    for n in nodes:
        if n is not None:
            n.stop()


def _model(coord) -> str:
    return coord.get("/v1/models")["data"][0]["id"]


def _stage_nodes(coord) -> list[str]:
    return [s["node_id"] for s in coord.status()["stages"]]


def _log_tail(node, n: int = 5000) -> str:
    """A node's log without llama.cpp's own lines (a model load writes hundreds)."""
    return "\n".join(line for line in node.log().splitlines() if "meshnode.llama_cpp" not in line)[-n:]


def _complete(coord, model: str, max_tokens: int = 24, others=()) -> str:
    r = httpx.post(f"{coord.base_url}/chat/completions", timeout=120,
                   json=dict(model=model, max_tokens=max_tokens, temperature=0,
                             messages=[{"role": "user", "content": "List three uses of a paperclip."}]))
    # (the logs say which stage and link a failed step waited on)
    assert r.status_code == 200, (f"{r.text}\n--- coordinator log ---\n{_log_tail(coord)}"
                                  + "".join(f"\n--- {o.name}'s log ---\n{_log_tail(o)}" for o in others))
    return r.json()["choices"][0]["message"]["content"]


def _kill_mid_stream(coord, victim, model: str, **params) -> Stream:
    s = Stream(coord.http_port, model, **params)
    wait_for(lambda: s.content_chunks() >= 12, 60, 0.005)
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(5)
    return s


def _assert_exact(s: Stream, reference: str) -> None:
    assert s.lines[-1][1] == "[DONE]", s.lines[-3:]
    assert not any("error" in c for c in s.chunks), [c for c in s.chunks if "error" in c]
    assert s.chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert s.text == reference


def _failover(coord) -> dict:
    fo = coord.status()["failovers"]
    assert fo, "no failover recorded"
    return fo[0]


def _wait_serving(coord, timeout: float = 60.0) -> None:
    def ready() -> bool:
        st = coord.status()
        return st["status"] == "ready" and st["failovers"] and all(s["state"] == "ready" for s in st["stages"])
    wait_for(ready, timeout, 0.1)


def test_kill_of_the_peer_stage_mid_stream_continues_exactly_with_speculation(smollm2, tmp_path):
    """3 nodes holding the model, a 2-stage split with n-gram speculation on: the stage-1
    node is killed mid-stream; the third node takes its range and the stream completes
    with the uninterrupted run's text. The request is penalized: the new final stage has
    no history of it, and needs none (each step carries the counts)."""
    coord, helpers = _cluster(smollm2, tmp_path, ["a", "b", "c"], "--split", "2", "--spec-mode", "on")
    try:
        model = _model(coord)
        reference = Stream(coord.http_port, model, frequency_penalty=0.2, presence_penalty=0.1).join().text
        assert len(reference) > 200, reference
        first = _stage_nodes(coord)
        victim = next(h for h in helpers.values() if h.node_id == first[1])
        spare = next(h for h in helpers.values() if h is not victim)
        s = _kill_mid_stream(coord, victim, model, frequency_penalty=0.2, presence_penalty=0.1)
        s.join()
        _assert_exact(s, reference)
        fo = _failover(coord)
        print(f"\ntime to resume (detection -> serving on {fo['stages_after']} stages): "
              f"{fo['resume_ms']:.0f} ms; requests waiting: {fo['requests']}")
        assert fo["cause"] == "lost" and fo["stages_before"] == 2 and fo["stages_after"] == 2
        assert fo["requests"] >= 1
        assert _stage_nodes(coord) == [coord.node_id, spare.node_id]
        assert coord.status()["status"] == "ready"
        assert "resumed on the new route" in coord.log()
        # stage 0 kept its range: the re-plan took its engine back rather than loading it
        assert "stage0: reusing the loaded engine" in coord.log()
        # speculation was in use on both routes, and the replay predicted the same token
        assert s.chunks[-1]["timings"]["draft_n"] > 0, s.chunks[-1].get("timings")
        # it began from the reference's KV, kept by the prefix cache (the replay rebuilt
        # it in full on the new route)
        assert s.chunks[-1]["timings"]["cache_n"] > 0, s.chunks[-1].get("timings")
        assert "the replay on the new route predicts" not in coord.log()
        # later requests are served (and the lost stage's node is out of the plan)
        assert _complete(coord, model)
    finally:
        _stop_all(coord, *helpers.values())


def test_replan_after_a_member_leaves_and_after_it_returns(smollm2, tmp_path):
    """--split 3 on 3 nodes, speculation off: the last stage's node is killed mid-stream;
    the model goes on with 2 stages (exact text); when the node comes back, a re-plan
    (taken when the model is idle) puts it in the plan again."""
    coord, helpers = _cluster(smollm2, tmp_path, ["a", "b", "c"], "--split", "3", "--spec-mode", "off")
    restarted = None
    try:
        model = _model(coord)
        reference = Stream(coord.http_port, model).join().text
        short_ref = _complete(coord, model)
        first = _stage_nodes(coord)
        assert len(first) == 3
        victim = next(h for h in helpers.values() if h.node_id == first[2])
        s = _kill_mid_stream(coord, victim, model)
        s.join()
        _assert_exact(s, reference)
        fo = _failover(coord)
        print(f"\ntime to resume (3 -> {fo['stages_after']} stages): {fo['resume_ms']:.0f} ms")
        assert fo["stages_before"] == 3 and fo["stages_after"] == 2
        assert victim.node_id not in _stage_nodes(coord)
        assert _complete(coord, model) == short_ref     # the next request, on fewer stages
        # the member comes back (same home, same node id)
        restarted = start_node(victim.home, victim.name, "--no-model", *NODE_FLAGS).wait_up(30)
        assert restarted.node_id == victim.node_id
        t0 = time.monotonic()
        wait_for(lambda: len(coord.status()["failovers"]) >= 2 and coord.status()["status"] == "ready"
                 and len(_stage_nodes(coord)) == 3, 90, 0.2)
        back = _failover(coord)
        print(f"re-plan to the member that came back: {time.monotonic() - t0:.1f} s after its start, "
              f"switch took {back['resume_ms']:.0f} ms")
        assert back["cause"] == "rejoined" and back["stages_after"] == 3 and back["requests"] == 0
        assert restarted.node_id in _stage_nodes(coord)
        # (a rare CI failure here: this request's first step never came back from the final
        # stage, 60 s; every node's log is printed if it happens again)
        others = [h for h in helpers.values() if h is not victim] + [restarted]
        assert _complete(coord, model, others=others) == short_ref
        assert [s["state"] for s in restarted.status()["stages"]] == ["ready"]
    finally:
        _stop_all(coord, restarted, *helpers.values())


def test_no_route_ends_the_stream_within_2s_of_the_detection(smollm2, tmp_path):
    """The coordinator's --max-memory fits stage 0 of a split but not the whole model:
    when the only peer dies, no plan fits; the stream gets an error chunk and [DONE]
    within 2 s of the detection, and the model reports why."""
    coord, helpers = _cluster(smollm2, tmp_path, ["a", "b"], "--split", "2", "--max-memory", "150MB",
                              "--spec-mode", "off")
    try:
        model = _model(coord)
        s = _kill_mid_stream(coord, helpers["b"], model)
        s.join(30)
        assert s.lines[-1][1] == "[DONE]"
        t_err, last = s.lines[-2]
        err = json.loads(last)
        assert "error" in err and "no route" in err["error"]["message"], err
        fo = _failover(coord)
        took = t_err - fo["t"]
        print(f"\nno route: error chunk {took * 1e3:.0f} ms after the detection")
        assert fo["stages_after"] == 0
        assert took < 2.0, took
        st = coord.status()
        assert st["status"] == "failed" and "no route" in st["status_detail"], st["status_detail"]
        r = httpx.post(f"{coord.base_url}/chat/completions", timeout=30,
                       json=dict(model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}]))
        assert r.status_code == 503 and "no route" in r.json()["error"]["message"], r.text
        assert "Traceback" not in coord.log()
    finally:
        _stop_all(coord, *helpers.values())
