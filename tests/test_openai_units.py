"""Pure-logic pieces of the OpenAI layer: stop matching, the error table, timings, the
keep-alive pump and request conversion."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from meshnode.engine.errors import (
    ContextOverflowError,
    DecodeError,
    EngineBusyError,
    EngineError,
    EngineInputError,
)
from meshnode.errors import MeshnodeError
from meshnode.mesh.fabric import PeerUnavailableError
from meshnode.serve.client import ChatMessage, GenerationRequest, StopMatcher, Timings
from meshnode.serve.errors import (
    ERROR_TABLE,
    EngineFailedError,
    EngineUnavailableError,
    InvalidRequestError,
    MalformedRequestError,
    PromptTooLongError,
    ServeError,
    UnknownModelError,
    UnsupportedValueError,
    error_body,
    error_spec,
)
from meshnode.serve.schemas import ChatCompletionRequest, CompletionRequest, parse_request
from meshnode.serve.sse import EventPump, KeepAliveTick, sse_data

# --- StopMatcher ----------------------------------------------------------------------


def _run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = ""
    for p in pieces:
        out += m.feed(p)
        if m.stopped:
            break
    return out + m.flush(), m.stopped


@pytest.mark.parametrize(
    ("stops", "pieces", "expected"),
    [
        ([], ["a", "b"], ("ab", False)),
        (["\n\n"], ["x", "\n", "\n", "y"], ("x", True)),
        (["\n\n"], ["x", "\n", "y"], ("x\ny", False)),
        (["END"], ["foo E", "N", "D bar"], ("foo ", True)),
        (["END"], ["foo EN"], ("foo EN", False)),              # partial at the end is released
        (["abc", "b"], ["ab"], ("a", True)),                   # earliest hit wins
        (["xyz"], ["aaxy", "zbb"], ("aa", True)),
        (["aab"], ["aa", "aab"], ("aa", True)),                 # overlapping prefix
        (["", "q"], ["pq"], ("p", True)),                       # empty stops are ignored
    ],
)
def test_stop_matcher(stops: list[str], pieces: list[str], expected: tuple[str, bool]) -> None:
    assert _run(stops, pieces) == expected


def test_stop_matcher_any_split_gives_the_same_text() -> None:
    text = "The answer is 42.\n\nUser: next"
    stops = ["\n\nUser:", "</s>"]
    for cut in range(1, len(text)):
        assert _run(stops, [text[:cut], text[cut:]]) == ("The answer is 42.", True)
    assert _run(stops, list(text)) == ("The answer is 42.", True)


def test_stop_matcher_never_emits_a_held_prefix_early() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("go ST") == "go "
    assert m.feed("O") == ""
    assert m.feed("P!") == "" and m.stopped
    assert m.feed("more") == "" and m.flush() == ""


# --- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code", "param"),
    [
        (InvalidRequestError("temperature", "bad"), 400, "invalid_request_error", "invalid_value", "temperature"),
        (UnsupportedValueError("n", "only 1"), 400, "invalid_request_error", "unsupported_value", "n"),
        (MalformedRequestError("not json"), 400, "invalid_request_error", "invalid_json", None),
        (UnknownModelError("m"), 404, "invalid_request_error", "model_not_found", "model"),
        (PromptTooLongError(100, 64), 400, "invalid_request_error", "context_length_exceeded", None),
        (EngineUnavailableError("no route"), 503, "server_error", "engine_unavailable", None),
        (EngineFailedError("boom"), 500, "server_error", "engine_failed", None),
    ],
)
def test_error_table(exc: ServeError, status: int, type_: str, code: str, param: str | None) -> None:
    assert isinstance(exc, MeshnodeError)
    assert error_spec(exc).status == status
    assert error_body(exc) == {"error": {"message": exc.message, "type": type_, "param": param, "code": code}}


def test_error_table_lookup_follows_subclasses() -> None:
    class NoRouteError(EngineUnavailableError):
        pass

    assert error_spec(NoRouteError("x")).status == 503
    assert set(ERROR_TABLE) >= {InvalidRequestError, UnknownModelError, PromptTooLongError,
                                EngineUnavailableError, EngineFailedError}


def test_an_unknown_model_id_is_echoed_short() -> None:
    # the id is the client's text: a 5000-character one is not repeated whole
    e = UnknownModelError("a" * 5000, ["m1"])
    assert "'" + "a" * UnknownModelError.ECHOED + "...'" in e.message and len(e.message) < 300
    assert e.model == "a" * 5000


def test_context_overflow_carries_numbers() -> None:
    e = PromptTooLongError(9000, 8192)
    assert (e.prompt_tokens, e.n_ctx) == (9000, 8192)
    assert "8192" in e.message and "9000" in e.message


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code"),
    [
        # the session outgrew a stage's context: the request was too long, not our failure
        (ContextOverflowError(130, 128), 400, "invalid_request_error", "context_length_exceeded"),
        # passing: the same request may succeed later
        (EngineBusyError("every slot is in use"), 503, "server_error", "engine_unavailable"),
        (PeerUnavailableError("no link to peer n2"), 503, "server_error", "engine_unavailable"),
        # ours
        (DecodeError("llama_decode returned -3"), 500, "server_error", "engine_failed"),
        (EngineInputError("rows of the wrong width"), 500, "server_error", "engine_failed"),
        (EngineError("anything else the engine raises"), 500, "server_error", "engine_failed"),
    ],
)
def test_error_table_maps_lower_layer_failures(exc: Exception, status: int, type_: str, code: str) -> None:
    spec = error_spec(exc)
    assert spec is not None and spec.status == status
    # a lower layer's failure names no request field; its message is its own
    assert error_body(exc) == {"error": {"message": str(exc), "type": type_, "param": None, "code": code}}


def test_error_table_classifies_by_type_never_by_message() -> None:
    # the same words in another type change nothing; another type with no row has no spec
    assert error_spec(EngineFailedError("context overflow: 130 positions needed")).status == 500
    assert error_spec(RuntimeError("context overflow: 130 positions needed")) is None
    assert error_spec(ValueError("no link to peer n2")) is None
    with pytest.raises(TypeError):
        error_body(RuntimeError("a bug"))


def test_serve_errors_do_not_reuse_engine_names() -> None:
    # one class per name: the serve layer's prompt check is not the engine's overflow
    import meshnode.engine.errors as engine_errors
    import meshnode.serve.errors as serve_errors

    def defined(module) -> set[str]:
        return {n for n, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__}

    assert not defined(serve_errors) & defined(engine_errors)
    assert error_spec(PromptTooLongError(9000, 8192)) == error_spec(ContextOverflowError(9000, 8192))


# --- timings, requests ----------------------------------------------------------------


def test_timings_json() -> None:
    t = Timings(prompt_n=10, prompt_ms=20.0, predicted_n=50, predicted_ms=1000.0, draft_n=40, draft_n_accepted=30)
    j = t.to_json()
    assert j["prompt_per_second"] == 500.0 and j["prompt_per_token_ms"] == 2.0
    assert j["predicted_per_second"] == 50.0 and j["predicted_per_token_ms"] == 20.0
    assert (j["draft_n"], j["draft_n_accepted"], j["draft_n_rejected"]) == (40, 30, 10)
    assert j["draft_acceptance"] == 0.75 and "spec_state" not in j
    assert Timings().to_json()["predicted_per_second"] == 0.0
    assert Timings().to_json()["draft_verify_ms_per_window"] == 0.0
    s = Timings(draft_windows=4, draft_verify_ms=100.0, plain_steps=3, spec_strategy="ngram",
                spec_state="enabled", spec_window=6).to_json()
    assert s["draft_verify_ms_per_window"] == 25.0 and s["plain_steps"] == 3
    assert (s["spec_strategy"], s["spec_state"], s["spec_window"]) == ("ngram", "enabled", 6)


def test_generation_request_needs_exactly_one_prompt() -> None:
    with pytest.raises(ValueError):
        GenerationRequest("r", "m")
    with pytest.raises(ValueError):
        GenerationRequest("r", "m", messages=(ChatMessage("user", "x"),), prompt="x")


def test_chat_request_conversion_defaults() -> None:
    body = parse_request(ChatCompletionRequest, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}],'
                                               b' "stop": "\\n", "top_k": 0, "weird": 1}')
    assert body.model_extra == {"weird": 1}
    req = body.to_generation_request("chatcmpl-1")
    assert req == GenerationRequest("chatcmpl-1", "m", messages=(ChatMessage("user", "hi"),),
                                    temperature=1.0, top_p=1.0, top_k=None, stop=("\n",))


def test_completion_request_single_prompt_list() -> None:
    body = parse_request(CompletionRequest, b'{"model": "m", "prompt": ["abc"], "max_tokens": 5, "seed": 3}')
    req = body.to_generation_request("cmpl-1")
    assert (req.prompt, req.messages, req.max_tokens, req.seed) == ("abc", None, 5, 3)
    body = parse_request(CompletionRequest, b'{"model": "m", "prompt": ["a", "b"]}')
    with pytest.raises(UnsupportedValueError):
        body.to_generation_request("cmpl-2")
    # a batch: one engine request per prompt, text or token ids
    reqs = body.to_generation_requests("cmpl-2")
    assert [(r.request_id, r.prompt) for r in reqs] == [("cmpl-2-0", "a"), ("cmpl-2-1", "b")]
    reqs = parse_request(CompletionRequest, b'{"model": "m", "prompt": [[1, 2], [3]]}').to_generation_requests("c")
    assert [r.prompt_ids for r in reqs] == [(1, 2), (3,)]
    for raw, param in ((b"[]", "prompt"), (b"[[1], []]", "prompt[1]")):
        with pytest.raises(InvalidRequestError) as ei:
            parse_request(CompletionRequest, b'{"model": "m", "prompt": ' + raw + b'}').to_generation_requests("c")
        assert ei.value.param == param
    with pytest.raises(UnsupportedValueError) as ei:
        parse_request(CompletionRequest, b'{"model": "m", "prompt": ["a", "b"], "suffix": "x"}'
                      ).to_generation_requests("c")
    assert ei.value.param == "suffix"
    # echo: max_tokens 0 only with it
    req = parse_request(CompletionRequest, b'{"model": "m", "prompt": "a", "echo": true, "max_tokens": 0}'
                        ).to_generation_request("c")
    assert req.echo and req.max_tokens == 0
    with pytest.raises(InvalidRequestError) as ei:
        parse_request(CompletionRequest, b'{"model": "m", "prompt": "a", "max_tokens": 0}').to_generation_request("c")
    assert ei.value.param == "max_tokens"
    # token ids, alone or as the one prompt of a list, go to the model as given
    for raw in (b"[5, 6, 7]", b"[[5, 6, 7]]"):
        req = parse_request(CompletionRequest, b'{"model": "m", "prompt": ' + raw + b'}').to_generation_request("c")
        assert (req.prompt_ids, req.prompt) == ((5, 6, 7), None)
    # bounded while parsing (off the event loop), with a message that says which bound
    from meshnode.serve.schemas import MAX_PROMPT_IDS, MAX_PROMPTS

    for prompt, why in (([1] * (MAX_PROMPT_IDS + 1), "token ids"), ([[1] * (MAX_PROMPT_IDS + 1)], "token ids"),
                        (["a"] * (MAX_PROMPTS + 1), "prompts")):
        with pytest.raises(InvalidRequestError, match=why) as ei:
            parse_request(CompletionRequest, json.dumps({"model": "m", "prompt": prompt}).encode())
        assert ei.value.param == "prompt"


def test_sse_data() -> None:
    assert sse_data({"a": "x\ny"}) == b'data: {"a":"x\\ny"}\n\n'
    assert sse_data("[DONE]") == b"data: [DONE]\n\n"


# --- EventPump --------------------------------------------------------------------------


async def test_event_pump_ticks_without_cancelling_the_source() -> None:
    log: list[str] = []

    async def source() -> AsyncIterator[int]:
        try:
            yield 1
            await asyncio.sleep(0.15)
            yield 2
        finally:
            log.append("closed")

    pump = EventPump(source(), interval=0.05)
    got = []
    while True:
        try:
            got.append(await pump.next())
        except StopAsyncIteration:
            break
    await pump.aclose()
    assert got[0] == 1 and got[-1] == 2
    assert any(isinstance(x, KeepAliveTick) for x in got[1:-1])
    assert log == ["closed"]


async def test_event_pump_aclose_cancels_a_pending_read() -> None:
    seen: list[str] = []

    async def source() -> AsyncIterator[int]:
        try:
            yield 1
            await asyncio.sleep(60)
            yield 2
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    pump = EventPump(source(), interval=0.01)
    assert await pump.next() == 1
    assert isinstance(await pump.next(), KeepAliveTick)
    await pump.aclose()
    await pump.aclose()  # idempotent
    assert seen == ["cancelled"]


async def test_event_pump_aclose_closes_a_parked_generator() -> None:
    seen: list[str] = []

    async def source() -> AsyncIterator[int]:
        try:
            yield 1
            yield 2
        except GeneratorExit:
            seen.append("aclose")
            raise

    pump = EventPump(source(), interval=1.0)
    assert await pump.next() == 1
    await pump.aclose()
    assert seen == ["aclose"]
