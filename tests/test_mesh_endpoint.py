"""The mesh-wide endpoint end to end: real node processes (real mDNS, QUIC, HTTP, llama.cpp).

A node that holds nothing (``serve --no-model``) lists its peer's model in /v1/models and
serves requests for it through the official openai client: the text is the coordinator's
own greedy text, stream and non-stream, with usage and timings; errors come back with the
coordinator's status and body; a client that goes away cancels the request on the
coordinator; a node of another mesh sees none of it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from meshnode.bench.cluster import link_model
from tests.nodeproc import meshnode_cmd, start_node, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.net]

FLAGS = ("--threads", "1", "--ctx", "512", "--batch", "64", "--parallel", "2")
PROMPT = [{"role": "user", "content": "List three uses of a paperclip."}]


def _same_mesh(homes: list[Path]) -> None:
    tok = meshnode_cmd("invite", "--home", str(homes[0])).stdout.strip().splitlines()[-1]
    for h in homes[1:]:
        r = meshnode_cmd("join", tok, "--home", str(h))
        assert r.returncode == 0, r.stderr


def _ready(node) -> bool:
    model = node.get("/health").get("model") or {}
    if model.get("state") == "failed":
        raise AssertionError(f"model failed: {model}\n{node.log()[-3000:]}")
    return model.get("state") == "ready"


@pytest.fixture(scope="module")
def mesh(smollm2, tmp_path_factory):
    """A coordinator of the default model and a node with an empty store, one mesh."""
    root = tmp_path_factory.mktemp("mesh-endpoint")
    coord_home, empty_home = root / "coord", root / "empty"
    link_model(coord_home, smollm2.path)
    empty_home.mkdir()
    _same_mesh([coord_home, empty_home])
    empty = start_node(empty_home, "empty", "--no-model", *FLAGS)
    coord = start_node(coord_home, "coord", "--model", str(smollm2.path), *FLAGS)
    try:
        coord.wait_up(30)
        empty.wait_up(30)
        wait_for(lambda: _ready(coord), 120, interval=0.25)
        # the coordinator's list reaches the member over their link
        wait_for(lambda: empty.get("/status").get("mesh_models"), 20, interval=0.1)
        yield coord, empty, coord.get("/v1/models")["data"][0]["id"]
    except BaseException:
        for n in (coord, empty):
            print(n.name, n.log()[-4000:])
        raise
    finally:
        for n in (coord, empty):
            n.stop()


def _client(node):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{node.info['http_port']}/v1", api_key="none", max_retries=0)


def test_empty_node_lists_the_peers_model_with_its_coordinator(mesh, smollm2):
    coord, empty, model = mesh
    [m] = _client(empty).models.list().data
    [local] = _client(coord).models.list().data
    assert m.id == local.id == model
    extra = m.model_extra["meshnode"]
    assert extra["coordinator"] == {"id": coord.node_id, "name": "coord"}
    assert extra["local"] is False and extra["context_length"] == 512
    assert local.model_extra["meshnode"]["local"] is True
    assert _client(empty).models.retrieve(m.id).id == m.id
    # meshnode status (the CLI) names the coordinator of the mesh's model
    out = meshnode_cmd("status", "--home", str(empty.home)).stdout
    assert model in out and "coordinated by coord" in out, out


def test_requests_through_an_empty_node_give_the_coordinators_greedy_text(mesh, smollm2):
    coord, empty, model = mesh
    args = dict(model=model, messages=PROMPT, max_tokens=24, temperature=0)
    direct = _client(coord).chat.completions.create(**args)
    through = _client(empty).chat.completions.create(**args)
    assert through.choices[0].message.content == direct.choices[0].message.content
    assert through.usage.completion_tokens == direct.usage.completion_tokens == 24
    assert through.usage.prompt_tokens == direct.usage.prompt_tokens
    assert through.model_extra["timings"]["predicted_n"] == 24

    stream = _client(empty).chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].model_extra["timings"]["predicted_n"] == 24

    # the legacy completions route too
    comp = dict(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    assert (_client(empty).completions.create(**comp).choices[0].text
            == _client(coord).completions.create(**comp).choices[0].text)
    # and the Responses API, streamed: the events are the coordinator's
    resp = dict(model=model, input=PROMPT, max_output_tokens=24, temperature=0)
    events = list(_client(empty).responses.create(**resp, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == direct.choices[0].message.content
    # kept on the coordinator: the next turn through the member continues it
    follow = _client(empty).responses.create(model=model, input="And one more?", max_output_tokens=8, temperature=0,
                                              previous_response_id=events[-1].response.id)
    assert follow.previous_response_id == events[-1].response.id and follow.output_text
    # llama.cpp's routes and the tokenizer's, with no model named: the mesh's model
    def both(path: str, body: dict) -> list[httpx.Response]:
        return [httpx.post(f"http://127.0.0.1:{n.info['http_port']}{path}", json=body, timeout=60)
                for n in (coord, empty)]
    direct_c, through_c = both("/completion", {"prompt": "The capital of France is", "n_predict": 8,
                                               "temperature": 0})
    assert through_c.status_code == 200 and through_c.json()["content"] == direct_c.json()["content"]
    direct_t, through_t = both("/tokenize", {"prompt": "The capital of France is"})
    assert through_t.json() == direct_t.json() and through_t.json()["count"] > 0
    # /tokenizer_info is a GET (lm-eval's remote tokenizer): the query travels, with or without a model
    for query in ("", f"?model={model}"):
        direct_ti, through_ti = (httpx.get(f"http://127.0.0.1:{n.info['http_port']}/tokenizer_info{query}", timeout=60)
                                 for n in (coord, empty))
        assert through_ti.status_code == 200 and through_ti.json() == direct_ti.json()
        assert through_ti.json()["eos_token"]
    long = httpx.get(f"http://127.0.0.1:{empty.info['http_port']}/tokenizer_info?model={model}&x={'y' * 9000}",
                     timeout=60)
    assert long.status_code == 400 and "query string" in long.json()["error"]["message"]
    # SmolLM2 has no FIM tokens: the coordinator's own 400 comes back
    direct_i, through_i = both("/infill", {"input_prefix": "def f(", "input_suffix": "):"})
    assert through_i.status_code == direct_i.status_code == 400 and through_i.json() == direct_i.json()
    assert coord.status()["mesh_requests"]["served_for_members"] >= 10
    assert empty.status()["mesh_requests"]["forwarded"] >= 10


def test_errors_come_back_with_the_coordinators_status_and_body(mesh, smollm2):
    coord, empty, model = mesh
    cases = [
        {"model": model, "messages": [{"role": "user", "content": "word " * 2000}]},   # too long
        {"model": model, "messages": PROMPT, "temperature": -1},                      # bad field
        {"model": "no-such-model", "messages": PROMPT},                                     # unknown
    ]
    for body in cases:
        a = httpx.post(f"http://127.0.0.1:{coord.info['http_port']}/v1/chat/completions", json=body, timeout=30)
        b = httpx.post(f"http://127.0.0.1:{empty.info['http_port']}/v1/chat/completions", json=body, timeout=30)
        assert a.status_code == b.status_code and a.status_code in (400, 404), (a.text, b.text)
        assert a.json() == b.json()


def test_client_disconnect_cancels_the_request_on_the_coordinator(mesh, smollm2):
    coord, empty, model = mesh
    before = coord.status()["mesh_requests"]["cancelled_by_members"]
    body = {"model": model, "messages": [{"role": "user", "content": "Tell a very long story."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{empty.info['http_port']}/v1/chat/completions",
                      json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break   # the first token arrived: leave
    # the coordinator ended it early: cancelled, fewer tokens than asked, nothing active
    def cancelled() -> bool:
        reqs = coord.status()["requests"]
        return bool(reqs) and reqs[0]["status"] == "cancelled"
    wait_for(cancelled, 10)
    first = coord.status()["requests"][0]
    assert first["generated_tokens"] < 400
    assert coord.status()["mesh_requests"]["cancelled_by_members"] == before + 1
    assert all(r["status"] not in ("queued", "prefill", "decoding") for r in coord.status()["requests"])


def test_a_node_of_another_mesh_sees_and_reaches_nothing(mesh, smollm2, tmp_path):
    coord, _, model = mesh
    served_before = coord.status()["mesh_requests"]["served_for_members"]
    stranger = start_node(tmp_path / "stranger", "stranger", "--no-model", "--peer",
                          f"127.0.0.1:{coord.quic_port}", *FLAGS)
    try:
        stranger.wait_up(30)
        time.sleep(3)   # mDNS and the dial to the coordinator had their chance
        assert stranger.status()["peers"] == []
        assert stranger.status()["mesh_models"] == []
        r = httpx.post(f"http://127.0.0.1:{stranger.info['http_port']}/v1/chat/completions",
                       json={"model": model, "messages": PROMPT}, timeout=30)
        assert r.status_code == 503, r.text   # no model here, none it could reach
        assert httpx.get(f"http://127.0.0.1:{stranger.info['http_port']}/v1/models").json()["data"] == []
        # and the coordinator neither linked with it nor served anything for it
        assert "stranger" not in coord.peer_names()
        assert coord.status()["mesh_requests"]["served_for_members"] == served_before
    finally:
        stranger.stop()


def test_coordinator_lost_mid_stream_ends_the_stream_with_an_error(smollm2, tmp_path):
    """Kill the coordinator while a request through the empty node streams: the client
    gets an error chunk and [DONE]; the next request gets a 503 at once."""
    coord_home, empty_home = tmp_path / "c", tmp_path / "e"
    link_model(coord_home, smollm2.path)
    empty_home.mkdir()
    _same_mesh([coord_home, empty_home])
    empty = start_node(empty_home, "empty2", "--no-model", *FLAGS)
    coord = start_node(coord_home, "coord2", "--model", str(smollm2.path), *FLAGS)
    try:
        coord.wait_up(30)
        empty.wait_up(30)
        wait_for(lambda: _ready(coord), 120, interval=0.25)
        wait_for(lambda: empty.get("/status").get("mesh_models"), 20, interval=0.1)
        model = coord.get("/v1/models")["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Tell a very long story."}],
                "max_tokens": 400, "temperature": 0, "stream": True}
        lines = []
        with httpx.stream("POST", f"http://127.0.0.1:{empty.info['http_port']}/v1/chat/completions",
                          json=body, timeout=30) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 4:
                    coord.proc.kill()   # no goodbye: the link dies by the dead-peer watch
        data = [ln[6:] for ln in lines if ln.startswith("data: ")]
        assert data[-1] == "[DONE]"
        assert "error" in json.loads(data[-2]), data[-3:]
        r = httpx.post(f"http://127.0.0.1:{empty.info['http_port']}/v1/chat/completions",
                       json={k: v for k, v in body.items() if k != "stream"}, timeout=30)
        assert r.status_code in (404, 503), r.text
    finally:
        for n in (coord, empty):
            n.stop()

