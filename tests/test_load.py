"""Load on real node processes: 16 concurrent streams on a 2-stage split answer exactly
what the same requests answer one at a time, and leave no KV behind on any stage; beyond
the queue, requests get 429 with Retry-After."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.nodeproc import TwoStageSplit, start_node, wait_for
from tests.test_split_serving import _home_with_model, _wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.net]

N_STREAMS = 16
TOPICS = ["the sea", "a lighthouse", "autumn", "a robot", "tea", "mountains", "a library", "rain",
          "a violin", "the moon", "bread", "a river", "snow", "a garden", "trains", "owls"]
PROMPTS = [f"Write two sentences about {t}." for t in TOPICS]
MAX_TOKENS = 16


def _stream(port: int, model: str, prompt: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}
    text, done = "", False
    with httpx.Client(timeout=300, trust_env=False) as c, \
            c.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk.get("choices"):
                    text += chunk["choices"][0]["delta"].get("content") or ""
    assert done
    return text


def test_sixteen_streams_on_a_split_equal_one_at_a_time(smollm2, tmp_path):
    flags = ("--threads", "1", "--ctx", "256", "--batch", "64", "--parallel", str(N_STREAMS),
             "--spec-mode", "off")
    split = TwoStageSplit(tmp_path, smollm2.path, flags)
    helper = split.stage1
    try:
        coord = split.start()
        port = coord.info["http_port"]
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        alone = [_stream(port, model, p) for p in PROMPTS]
        with ThreadPoolExecutor(N_STREAMS) as ex:
            together = list(ex.map(lambda p: _stream(port, model, p), PROMPTS))
        assert together == alone
        assert len(set(alone)) > 1                       # different prompts, different answers
        # every session's KV is freed on both stages once the answers are complete
        # (but the sessions the prefix cache keeps for later prompts, the same on both)
        wait_for(lambda: len(helper.status().get("stage_sessions"))
                 == coord.status()["prefix_cache"]["sessions"] == coord.status().get("model_sessions"), 15)
    except BaseException:
        for n in (split.coord, helper):
            if n is not None:
                print(n.log()[-3000:])
        raise
    finally:
        split.close()


def test_beyond_the_queue_requests_get_429_with_retry_after(smollm2, tmp_path):
    home = _home_with_model(tmp_path, "solo", smollm2.path)
    node = start_node(home, "solo", "--model", str(smollm2.path), "--threads", "1", "--ctx", "256",
                      "--parallel", "1", "--max-queue", "1", "--spec-mode", "off")
    try:
        node.wait_up(30)
        _wait_ready(node)
        port = node.info["http_port"]
        body = {"model": "x", "messages": [{"role": "user", "content": "Count to one hundred."}],
                "max_tokens": 48, "temperature": 0}
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        body["model"] = model

        def post(_):
            return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)

        with ThreadPoolExecutor(5) as ex:
            replies = list(ex.map(post, range(5)))
        codes = sorted(r.status_code for r in replies)
        assert codes.count(200) >= 2 and 429 in codes, codes     # one running, one queued, the rest refused
        for r in replies:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["type"]
        # every slot comes back; one finished session stays kept for prefix reuse
        def settled() -> bool:
            st = node.status()
            return st.get("model_sessions") == st["prefix_cache"]["sessions"] <= 1
        wait_for(settled, 15)
    finally:
        node.stop()
