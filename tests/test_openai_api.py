"""The OpenAI layer end to end: real uvicorn on 127.0.0.1:0, the official ``openai`` client
and raw httpx, in front of a small deterministic fake engine client (and, for the engine's
and the mesh's failures, the real ModelServer over a fake pipeline)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest
from fastapi import FastAPI

from meshnode.engine.errors import ContextOverflowError
from meshnode.mesh.fabric import PeerUnavailableError
from meshnode.serve.client import (
    Admitted,
    EngineClient,
    Finished,
    GenerationEvent,
    GenerationRequest,
    ModelCard,
    StopMatcher,
    TextDelta,
    Timings,
    Usage,
)
from meshnode.serve.errors import (EngineFailedError, EngineUnavailableError, PromptTooLongError, UnknownModelError,
                                   UnsupportedValueError)
from meshnode.mesh.final import Finalized
from meshnode.serve.model_server import ModelServer, ServeSettings
from meshnode.serve.openai_routes import make_openai_router
from char_tokenizer import CharTokenizer
from inproc import serve_app

MODEL = "fake-model"
N_CTX = 64
SCRIPT = ["Hello", " world", ",", " this", " is", " a", " fake", " engine", "."]
ANSWER = "".join(SCRIPT)


class FakeEngine:
    """Deterministic engine client. Behaviour keyed by words in the prompt:
    ``slow`` endless tokens every 20 ms; ``pause`` a 0.5 s gap after the first token;
    ``fail`` an EngineFailedError after two tokens; ``offline`` EngineUnavailableError;
    ``cached`` two prompt tokens' KV reused (as prefix reuse reports it)."""

    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []
        self.outcomes: dict[str, str] = {}   # request_id -> finished | cancelled | closed | failed
        self._lock = threading.Lock()

    def models(self) -> list[ModelCard]:
        return [ModelCard(MODEL, created=1_700_000_000, n_ctx=N_CTX)]

    def outcome(self, request_id: str, timeout: float = 5.0) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if request_id in self.outcomes:
                    return self.outcomes[request_id]
            time.sleep(0.01)
        return None

    def last_request(self, word: str) -> GenerationRequest:
        return next(r for r in reversed(self.requests) if word in _prompt_text(r))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self.requests.append(request)
        if request.model not in {card.id for card in self.models()}:
            raise UnknownModelError(request.model)
        if request.infill is not None:   # like a model without FIM tokens
            raise UnsupportedValueError("suffix", f"{MODEL} cannot fill in the middle.")
        prompt = _prompt_text(request)
        prompt_tokens = len(prompt.split())
        if "offline" in prompt:
            raise EngineUnavailableError("No route to the model's stages.")
        if prompt_tokens > N_CTX:
            raise PromptTooLongError(prompt_tokens, N_CTX)
        outcome = "closed"
        try:
            yield Admitted(prompt_tokens)
            stop = StopMatcher(request.stop)
            n = 0
            limit = request.max_tokens if request.max_tokens is not None else N_CTX - prompt_tokens
            reason = "stop"
            while True:
                if "slow" in prompt:
                    piece = f" t{n}"
                    await asyncio.sleep(0.02)
                elif n < len(SCRIPT):
                    piece = SCRIPT[n]
                else:
                    break
                if n >= limit:
                    reason = "length"
                    break
                if "fail" in prompt and n == 2:
                    raise EngineFailedError("Stage 1 went away.")
                if "pause" in prompt and n == 1:
                    await asyncio.sleep(0.5)
                n += 1
                text = stop.feed(piece)
                yield TextDelta(text, (n,))
                if stop.stopped:
                    break
            if tail := stop.flush():
                yield TextDelta(tail)
            outcome = "finished"
            cached = 2 if "cached" in prompt else 0
            yield Finished(
                reason,
                Usage(prompt_tokens, n),
                Timings(prompt_n=prompt_tokens - cached, cache_n=cached, prompt_ms=5.0, predicted_n=n,
                        predicted_ms=2.0 * n, draft_n=4, draft_n_accepted=3),
            )
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except EngineFailedError:
            outcome = "failed"
            raise
        finally:
            with self._lock:
                self.outcomes[request.request_id] = outcome


def _prompt_text(r: GenerationRequest) -> str:
    return r.prompt if r.prompt is not None else " ".join(m.content for m in r.messages or ())


_: type[EngineClient] = FakeEngine  # structural check for type checkers


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def base_url(engine: FakeEngine) -> Iterator[str]:
    app = FastAPI()
    app.include_router(make_openai_router(lambda: engine, keepalive_s=0.1))
    for base in serve_app(app):
        yield base + "/v1"


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=10)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _post(base_url: str, path: str, body: object, **kw: object) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(base_url + path, content=content, headers={"content-type": "application/json"},
                      timeout=10, **kw)


def _sse_lines(text: str) -> list[str]:
    return [block for block in text.split("\n\n") if block]


# --- the official client ----------------------------------------------------------------


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "meshnode"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_non_streaming(client: openai.OpenAI, engine: FakeEngine) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "be brief"}, *_user("hi there")],
        max_tokens=50, temperature=0.2, top_p=0.9, seed=7,
    )
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ANSWER
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (4, 9, 13)
    timings = (resp.model_extra or {})["timings"]
    assert timings["prompt_n"] == 4 and timings["predicted_n"] == 9
    assert timings["predicted_per_second"] == pytest.approx(500.0)
    assert (timings["draft_n"], timings["draft_n_accepted"]) == (4, 3)
    req = engine.last_request("hi there")
    assert req.request_id == resp.id and req.model == MODEL
    assert (req.max_tokens, req.temperature, req.top_p, req.seed) == (50, 0.2, 0.9, 7)
    assert [(m.role, m.content) for m in req.messages or ()] == [("system", "be brief"), ("user", "hi there")]


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=_user("stream please"), stream=True, stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finish] == ["stop"]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (2, 9)
    assert (last.model_extra or {})["timings"]["predicted_n"] == 9
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_usage_reports_the_prompt_tokens_served_from_kept_kv(client: openai.OpenAI) -> None:
    cold = client.chat.completions.create(model=MODEL, messages=_user("a fresh prompt"))
    assert cold.usage is not None and cold.usage.prompt_tokens_details is not None
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = list(client.chat.completions.create(
        model=MODEL, messages=_user("the cached prompt"), stream=True, stream_options={"include_usage": True}))
    usage = warm[-1].usage
    assert usage is not None and usage.prompt_tokens == 3
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 2
    assert (warm[-1].model_extra or {})["timings"]["cache_n"] == 2


def test_chat_streaming_without_usage_puts_timings_on_finish_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=_user("x"), stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is None
    assert "timings" in (chunks[-1].model_extra or {})


def test_completions_non_streaming_and_streaming(client: openai.OpenAI, engine: FakeEngine) -> None:
    resp = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=20)
    assert resp.object == "text_completion"
    assert resp.choices[0].text == ANSWER and resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None and resp.usage.prompt_tokens == 3
    assert engine.last_request("def add").prompt == "def add(a, b):"
    chunks = list(client.completions.create(
        model=MODEL, prompt=["def add(a, b):"], stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ANSWER
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9


async def test_async_client_streaming(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as aclient:
        stream = await aclient.chat.completions.create(model=MODEL, messages=_user("async"), stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == ANSWER


def test_max_tokens_gives_length(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=_user("short"), max_tokens=3)
    assert resp.choices[0].message.content == "Hello world,"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 3
    resp = client.chat.completions.create(model=MODEL, messages=_user("short"), max_completion_tokens=2)
    assert resp.choices[0].message.content == "Hello world"


@pytest.mark.parametrize(
    ("stop", "expected"),
    [([" fake"], "Hello world, this is a"), ("is a f", "Hello world, this "), (["zzz", "."], "Hello world, this is a fake engine"),
     (["never"], ANSWER)],
)
def test_stop_strings(client: openai.OpenAI, stop: str | list[str], expected: str) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=_user("stop test"), stop=stop)
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=_user("stop test"), stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def test_unknown_model_via_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=_user("x"))
    assert info.value.code == "model_not_found"


def test_in_band_error_via_client(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=_user("please fail"), stream=True)
    got: list[str] = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            got.append(chunk.choices[0].delta.content or "")
    assert "".join(got) == "Hello world"
    assert "Stage 1 went away" in info.value.message


def test_keep_alive_is_harmless_to_the_client(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=_user("pause"), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ANSWER


# --- raw HTTP -------------------------------------------------------------------------


def _error(resp: httpx.Response, status: int) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_malformed_json_is_400(base_url: str, raw: bytes) -> None:
    err = _error(_post(base_url, "/chat/completions", raw), 400)
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"


def test_unknown_model_is_404(base_url: str) -> None:
    err = _error(_post(base_url, "/chat/completions", {"model": "nope", "messages": _user("x")}), 404)
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "model_not_found", "model")
    assert f"Served: {MODEL} (GET /v1/models" in err["message"], err     # what to write instead
    err = _error(_post(base_url, "/completions", {"model": "nope", "prompt": "x", "stream": True}), 404)
    assert err["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("patch", "param", "code"),
    [
        ({"temperature": -1}, "temperature", "invalid_value"),
        ({"temperature": 2.5}, "temperature", "invalid_value"),
        ({"top_p": 1.5}, "top_p", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"max_tokens": "many"}, "max_tokens", "invalid_value"),
        ({"n": 9}, "n", "invalid_value"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "invalid_value"),
        ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"stop": ["ok", ""]}, "stop", "invalid_value"),
        ({"messages": []}, "messages", "invalid_value"),
        ({"messages": None}, "messages", "invalid_value"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_value"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]", "invalid_value"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content[0].type", "unsupported_value"),
        ({"model": None}, "model", "invalid_value"),
    ],
)
def test_bad_parameters_are_400_with_param(base_url: str, patch: dict[str, object], param: str, code: str) -> None:
    body = {"model": MODEL, "messages": _user("x"), **patch}
    err = _error(_post(base_url, "/chat/completions", body), 400)
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)


def test_missing_field_is_400(base_url: str) -> None:
    err = _error(_post(base_url, "/chat/completions", {"model": MODEL}), 400)
    assert err["param"] == "messages" and "Missing required parameter" in str(err["message"])
    for bad in ([], ["a", 1], [[1, 2], "a"]):
        err = _error(_post(base_url, "/completions", {"model": MODEL, "prompt": bad}), 400)
        assert err["param"] == "prompt", bad
    err = _error(_post(base_url, "/completions", {"model": MODEL, "prompt": [1, 2], "suffix": "x"}), 400)
    assert err["param"] == "suffix"
    err = _error(_post(base_url, "/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}), 400)
    assert err["param"] == "suffix"


@pytest.mark.parametrize("stream", [False, True])
def test_context_overflow_is_400(base_url: str, stream: bool) -> None:
    long = " ".join(["word"] * (N_CTX + 1))
    err = _error(_post(base_url, "/chat/completions", {"model": MODEL, "messages": _user(long), "stream": stream}), 400)
    assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")
    assert str(N_CTX) in str(err["message"])
    err = _error(_post(base_url, "/completions", {"model": MODEL, "prompt": long, "stream": stream}), 400)
    assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt")


def test_engine_unavailable_is_503(base_url: str) -> None:
    err = _error(_post(base_url, "/chat/completions", {"model": MODEL, "messages": _user("offline")}), 503)
    assert (err["type"], err["code"]) == ("server_error", "engine_unavailable")


def test_unknown_extra_fields_are_accepted(base_url: str, engine: FakeEngine) -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "developer", "content": "rules", "name": "ed"},
            {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "extras"}],
             "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": "auto", "parallel_tool_calls": False, "response_format": {"type": "text"},
        "min_p": 0.05, "cache_prompt": True, "top_k": 40, "presence_penalty": 0.5, "user": "me",
        "stream_options": {"include_usage": False, "vendor": 1}, "metadata": {"editor": "x"},
    }
    resp = _post(base_url, "/chat/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == ANSWER
    req = engine.last_request("part one")
    assert [(m.role, m.content) for m in req.messages or ()] == [("system", "rules"), ("user", "part one\nextras")]
    assert req.top_k == 40


def test_stream_wire_format(base_url: str) -> None:
    body = {"model": MODEL, "messages": _user("wire"), "stream": True, "stream_options": {"include_usage": True}}
    resp = _post(base_url, "/chat/completions", body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = _sse_lines(resp.text)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-2]["choices"][0]["finish_reason"] == "stop" and payloads[-2]["choices"][0]["delta"] == {}
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["total_tokens"] == 10
    assert set(payloads[-1]["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms",
                                            "predicted_per_second", "draft_n", "draft_n_accepted"}


def test_in_band_error_after_stream_start(base_url: str, engine: FakeEngine) -> None:
    resp = _post(base_url, "/chat/completions", {"model": MODEL, "messages": _user("fail now"), "stream": True})
    assert resp.status_code == 200
    events = _sse_lines(resp.text)
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert (err["type"], err["code"]) == ("server_error", "engine_failed")
    first = json.loads(events[0].removeprefix("data: "))
    assert engine.outcome(first["id"]) == "failed"


def test_keep_alive_comments_while_engine_is_silent(base_url: str) -> None:
    resp = _post(base_url, "/chat/completions", {"model": MODEL, "messages": _user("pause"), "stream": True})
    events = _sse_lines(resp.text)
    assert ": keep-alive" in events
    assert events[-1] == "data: [DONE]"


def test_client_disconnect_mid_stream_cancels_generation(base_url: str, engine: FakeEngine) -> None:
    body = {"model": MODEL, "messages": _user("slow"), "stream": True, "max_tokens": 10_000}
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", base_url + "/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            data = []
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    data.append(json.loads(line.removeprefix("data: ")))
                if len(data) == 4:
                    break
    request_id = data[0]["id"]
    assert engine.outcome(request_id) in ("cancelled", "closed")


def test_client_disconnect_non_streaming_cancels_generation(base_url: str, engine: FakeEngine) -> None:
    body = {"model": MODEL, "messages": _user("slow nonstream"), "max_tokens": 10_000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    req = engine.last_request("slow nonstream")
    assert engine.outcome(req.request_id) in ("cancelled", "closed")


def test_a_batch_of_prompts_answers_each_in_order(client: openai.OpenAI, engine: FakeEngine) -> None:
    """OpenAI's batch: prompt i's choice at index i (n > 1 against a real model:
    tests/test_api_features.py), usage summed over the prompts, streamed and not; every
    prompt its own engine request."""
    prompts = [f"batch prompt {i}" + " word" * i for i in range(6)]
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3)
    assert [c.index for c in resp.choices] == list(range(6))
    assert all(c.text == "Hello world," and c.finish_reason == "length" for c in resp.choices)
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == sum(len(p.split()) for p in prompts)
    assert resp.usage.completion_tokens == 6 * 3
    ids = sorted(r.request_id for r in engine.requests if "batch prompt" in _prompt_text(r))[-6:]
    assert ids == [f"{resp.id}-{i}" for i in range(6)]
    assert all(engine.outcome(i) == "finished" for i in ids)
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {i: "Hello world," for i in range(6)}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 18
    # token ids too
    r = _post(client.base_url.__str__().rstrip("/"), "/completions",
              {"model": MODEL, "prompt": [[1, 2], [3]], "max_tokens": 1})
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1]


def test_a_batch_fails_whole_and_frees_every_prompt(base_url: str, engine: FakeEngine) -> None:
    """A failing prompt fails the batch; a client that leaves cancels every prompt running."""
    r = _post(base_url, "/completions", {"model": MODEL, "prompt": ["fine one", "fail two", "fine three"],
                                         "max_tokens": 5})
    assert r.status_code == 500 and "Stage 1 went away" in r.json()["error"]["message"]
    r = _post(base_url, "/completions", {"model": MODEL, "prompt": ["fine", "offline"], "max_tokens": 5})
    assert r.status_code == 503
    body = {"model": MODEL, "prompt": [f"slow batch {i}" for i in range(3)], "max_tokens": 10_000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    for i in range(3):
        req = engine.last_request(f"slow batch {i}")
        assert engine.outcome(req.request_id) in ("cancelled", "closed")


# --- the real ModelServer: failures of the engine and the mesh ---------------------------

SERVED_CTX = 256    # the model server's context per request
STAGE_CTX = 48      # ... but a stage holds less: a long answer overflows it mid-decode


class _FailingStages:
    """A one-token-at-a-time "model" (it always says ``a``) whose stage holds
    ``STAGE_CTX`` positions and raises as the engine does past them; a prompt saying
    ``gone`` loses its peer instead."""

    n_stages = 2

    async def run(self, steps):
        for s in steps:
            if s.pos == 0 and "gone" in "".join(map(chr, s.tokens)):
                raise PeerUnavailableError("no link to peer n2")
            if s.pos + len(s.tokens) > STAGE_CTX:
                raise ContextOverflowError(s.pos + len(s.tokens), STAGE_CTX)
        return [Finalized((ord("a"),), 0, 0) if s.n_logits else None for s in steps]

    async def end_session(self, session: int) -> None: ...

    async def close(self) -> None: ...


@pytest.fixture(scope="module")
def served_url() -> Iterator[str]:
    servers: list[ModelServer] = []

    def get_client() -> ModelServer:
        if not servers:   # built on uvicorn's loop: the scheduler's task lives there
            servers.append(ModelServer(ServeSettings(MODEL, n_ctx=SERVED_CTX), CharTokenizer(),
                                       _FailingStages()))
        return servers[0]

    app = FastAPI()
    app.include_router(make_openai_router(get_client, keepalive_s=0.1))
    for base in serve_app(app):
        yield base + "/v1"


def test_model_server_answers_within_the_stage_context(served_url: str) -> None:
    resp = _post(served_url, "/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "aaaaa"


def test_engine_context_overflow_is_400_with_a_clear_message(served_url: str) -> None:
    # the prompt fits the model server's context; the answer outgrows the stage's
    body = {"model": MODEL, "prompt": "overflow " * 2, "max_tokens": 100}
    err = _error(_post(served_url, "/completions", body), 400)
    assert (err["type"], err["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert str(STAGE_CTX) in str(err["message"]) and "context" in str(err["message"])
    # streaming: the stream had started, so the same error arrives in-band
    resp = _post(served_url, "/completions", {**body, "stream": True})
    assert resp.status_code == 200
    events = _sse_lines(resp.text)
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert err["code"] == "context_length_exceeded" and str(STAGE_CTX) in err["message"]


def test_prompt_longer_than_the_served_context_is_400_before_prefill(served_url: str) -> None:
    long = "x" * (SERVED_CTX + 1)    # (a prompt of SERVED_CTX tokens fits: it gets one token)
    for stream in (False, True):
        err = _error(_post(served_url, "/chat/completions",
                           {"model": MODEL, "messages": _user(long), "stream": stream}), 400)
        assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")
        assert str(SERVED_CTX) in str(err["message"])


def test_lost_peer_is_503(served_url: str) -> None:
    err = _error(_post(served_url, "/completions", {"model": MODEL, "prompt": "gone", "max_tokens": 5}), 503)
    assert (err["type"], err["code"]) == ("server_error", "engine_unavailable")
    assert "n2" in str(err["message"])
