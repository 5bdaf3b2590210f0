"""Split serving end to end: real node processes on loopback (real mDNS, QUIC, HTTP),
the official openai client, greedy output compared token for token with one node."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from meshnode.bench.cluster import link_model
from tests.nodeproc import meshnode_cmd, start_node, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.net]

PROMPTS = [
    "Write a haiku about autumn leaves.",
    "What is the capital of France? Answer in one sentence.",
    "def fibonacci(n):\n    # complete this function\n",
    "List three uses of a paperclip.",
]
MAX_TOKENS = 24
NODE_FLAGS = ("--threads", "1", "--ctx", "512", "--batch", "64", "--parallel", "2")


def _home_with_model(root: Path, name: str, model: Path) -> Path:
    """A node home whose store holds ``model`` (hard link: no copy of the bytes)."""
    home = root / name
    link_model(home, model)
    return home


def _same_mesh(homes: list[Path]) -> None:
    tok = meshnode_cmd("invite", "--home", str(homes[0])).stdout.strip().splitlines()[-1]
    for h in homes[1:]:
        r = meshnode_cmd("join", tok, "--home", str(h))
        assert r.returncode == 0, r.stderr


def _wait_ready(node, timeout: float = 120.0) -> None:
    def ready() -> bool:
        model = node.get("/health").get("model") or {}
        if model.get("state") == "failed":
            raise AssertionError(f"model failed: {model}\n{node.log()[-3000:]}")
        return model.get("state") == "ready"
    wait_for(ready, timeout, interval=0.25)


@contextlib.contextmanager
def solo_node(root: Path, model: Path, *flags: str):
    """One node serving ``model`` whole (``NODE_FLAGS``, ``flags``), ready; stopped after."""
    node = start_node(_home_with_model(root, "solo", model), "solo", "--model", str(model), *NODE_FLAGS, *flags)
    try:
        node.wait_up(30)
        _wait_ready(node)
        yield node
    finally:
        node.stop()


def _asker(port: int):
    """A function that asks the node on ``port`` one prompt (greedy) and returns the text."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id

    def ask(p: str) -> str:
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                           max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0].message.content
    return ask


def _complete_all(port: int) -> list[str]:
    ask = _asker(port)
    return [ask(p) for p in PROMPTS]


def _complete_all_at_once(port: int) -> list[str]:
    """The prompts' answers, all requests at once (decoded together)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        return list(ex.map(_asker(port), PROMPTS))


@pytest.fixture(scope="module")
def single_node_outputs(smollm2, tmp_path_factory) -> list[str]:
    """The reference: the same prompts on one node (whole model, same batch schedule)."""
    with solo_node(tmp_path_factory.mktemp("single"), smollm2.path) as node:
        return _complete_all(node.info["http_port"])


def _run_split(smollm2, root: Path, n_stages: int, wire: str = "f32"):
    names = [f"n{i}" for i in range(n_stages)]
    homes = [_home_with_model(root, n, smollm2.path) for n in names]
    _same_mesh(homes)
    helpers = [start_node(h, n, "--no-model", *NODE_FLAGS) for h, n in zip(homes[1:], names[1:])]
    coord = None
    try:
        for h in helpers:
            h.wait_up(30)
        coord = start_node(homes[0], names[0], "--model", str(smollm2.path), "--split", str(n_stages),
                           "--wire-dtype", wire, *NODE_FLAGS).wait_up(30)
        _wait_ready(coord)
        status = coord.status()
        stages = status["stages"]
        assert [s["state"] for s in stages] == ["ready"] * n_stages, stages
        assert stages[0]["layers"][0] == 0 and stages[-1]["layers"][1] == smollm2.n_layers
        assert len({s["node_id"] for s in stages}) == n_stages
        return _complete_all(coord.info["http_port"]), coord, helpers
    except BaseException:
        for n in [coord, *helpers]:
            if n is not None:
                print(n.log()[-4000:])
                n.stop()
        raise


@pytest.mark.parametrize("n_stages", [2, 3])
def test_split_output_equals_single_node(smollm2, single_node_outputs, tmp_path, n_stages):
    outputs, coord, helpers = _run_split(smollm2, tmp_path, n_stages)
    try:
        assert outputs == single_node_outputs
        # the per-token frames had the fast lane between every pair of these processes
        # (tests/test_split_runtime.py counts the steps that took it)
        for n in [coord, *helpers]:
            assert all(p["lane"] for p in n.status()["peers"]), n.status()["peers"]
        # Stop releases every stage's memory: the helpers report no stage any more.
        coord.stop()
        wait_for(lambda: all(not h.status()["stages"] or
                             all(s["state"] in ("stopped",) for s in h.status()["stages"])
                             for h in helpers), 10)
    finally:
        for n in [coord, *helpers]:
            n.stop()


def test_the_gpu_call_paths_keep_every_answer_on_cpu(smollm2, single_node_outputs, tmp_path, monkeypatch):
    """A GPU engine's call paths (lone steps padded to 2 rows, sessions of a call in
    alone-alike calls, small calls 4 rows wide after a window) through a 2-stage split,
    on CPU where no row may change for them: answers one by one and all at once equal
    one node's (CI has no GPU; docs/engine.md "GPU")."""
    monkeypatch.setenv("MESHNODE_CPU_PAD_ROWS", "2")
    monkeypatch.setenv("MESHNODE_GPU_STICKY_CALLS", "32")
    outputs, coord, helpers = _run_split(smollm2, tmp_path, 2)
    try:
        for n in [coord, *helpers]:   # the engines took the GPU's paths
            assert "CPU engine padding calls to 2 rows" in n.log(), n.log()[-3000:]
        assert outputs == single_node_outputs
        assert _complete_all_at_once(coord.info["http_port"]) == single_node_outputs
    finally:
        for n in [coord, *helpers]:
            n.stop()


def test_f16_wire_agreement(smollm2, single_node_outputs, tmp_path):
    """f16 activations are not exact by design: measure and report token agreement."""
    outputs, coord, helpers = _run_split(smollm2, tmp_path, 2, wire="f16")
    try:
        same = sum(a == b for a, b in zip(outputs, single_node_outputs))
        chars = sum(len(os.path.commonprefix([a, b])) for a, b in zip(outputs, single_node_outputs))
        total = sum(len(b) for b in single_node_outputs)
        print(f"\nf16 wire: {same}/{len(PROMPTS)} prompts identical, "
              f"{100 * chars / max(1, total):.1f}% of reference text in the common prefix")
        assert all(isinstance(o, str) and o for o in outputs)
    finally:
        for n in [coord, *helpers]:
            n.stop()


def test_concurrent_requests_and_disconnect_free_every_stage(smollm2, single_node_outputs, tmp_path):
    """Concurrent requests are decoded together (continuous batching) and each still gets
    its own answer; a client that goes away cancels its request and frees its KV on
    every stage. Three stages: the end of a session reaches the last one through the
    middle one, which relays it."""
    import httpx

    _, coord, helpers = _run_split(smollm2, tmp_path, 3)
    port = coord.info["http_port"]
    try:
        answers = _complete_all_at_once(port)
        # one KV stream per session: an answer does not depend on what runs beside it
        assert answers == single_node_outputs

        model = coord.get("/v1/models")["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Tell a very long story."}],
                "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                chunks = 0
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        chunks += 1
                    if chunks >= 4:
                        break  # leaving the block closes the connection mid-stream
        wait_for(lambda: any(q["status"] == "cancelled" for q in coord.status()["requests"]), 15)
        # (but the sessions the prefix cache keeps for later prompts, the same on every stage)
        wait_for(lambda: len(helpers[0].status().get("stage_sessions"))
                 == len(helpers[1].status().get("stage_sessions"))
                 == coord.status()["prefix_cache"]["sessions"] == coord.status().get("model_sessions"), 15)
        assert helpers[0].status()["stage_sessions"] == helpers[1].status()["stage_sessions"]
    finally:
        for n in [coord, *helpers]:
            n.stop()


def test_a_context_above_the_trained_one_is_served_as_the_trained_one(smollm2, tmp_path):
    """``--ctx`` past the model's trained context (SmolLM2: 8192): the stages load with
    8192, and the endpoint says so and refuses a longer prompt up front (a 400, not an
    overflow in the middle of the answer)."""
    import httpx

    with solo_node(tmp_path, smollm2.path, "--ctx", "16384") as node:
        base = f"http://127.0.0.1:{node.info['http_port']}"
        [card] = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
        assert card["context_length"] == 8192
        r = httpx.post(f"{base}/v1/completions", json={"model": card["id"], "prompt": [1] * 8200, "max_tokens": 1},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
