"""Tools and structured output, pure parts: reading tool calls back (whole and streamed),
request validation, schema -> grammar -> masks (llguidance over a byte vocabulary), mask
application at the final stage, and the GrammarMask frame."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from meshnode import wire
from meshnode.mesh.final import (
    Counts, FinalSampler, Sampling, apply_bias, apply_mask, apply_penalties, apply_repetition, recent_tokens,
)
from meshnode.serve.client import ChatMessage, ToolCall
from meshnode.serve.errors import InvalidRequestError
from meshnode.serve.schemas import ChatCompletionRequest, parse_request
from meshnode.serve.structured import Constraint, compile_constraint
from meshnode.serve.tools import (
    FALLBACK_TOOLS_PROMPT,
    TOOL_CLOSE,
    TOOL_OPEN,
    Structure,
    ToolCallParser,
    ToolSpec,
    format_call,
    render_messages,
    split_tool_calls,
)

WEATHER = ToolSpec("get_weather", "weather", {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False})
ANSWER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
EOS = 256


class _Bytes:
    """A byte-level vocabulary (token i = byte i, 256 = end of generation)."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]
    special_token_ids = [EOS]

    def __call__(self, s: bytes) -> list[int]:
        return list(s)


class _ByteTokenizer:
    n_vocab = 257

    def __init__(self) -> None:
        self._lltok = LLTokenizer(TokenizerWrapper(_Bytes()))

    def grammar_tokenizer(self) -> LLTokenizer:
        return self._lltok


@pytest.fixture(scope="module")
def byte_tok() -> _ByteTokenizer:
    return _ByteTokenizer()


# --- reading calls back ------------------------------------------------------------------


def test_whole_answer_is_split_into_content_and_calls():
    content, calls, at = split_tool_calls("Let me check.\n" + ANSWER, ["get_weather"])
    assert content == "Let me check." and at == 0
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]
    assert calls[0].id.startswith("call_")


def test_unknown_tool_or_malformed_block_stays_content():
    text = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    assert split_tool_calls(text, ["get_weather"]) == (text, [], 0)
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert split_tool_calls(bad, ["get_weather"]) == (bad, [], 0)


def test_where_the_content_stands_among_the_calls():
    # the Responses API lists a whole answer's message where a stream would add it
    assert split_tool_calls(f"{ANSWER}\nDone.", ["get_weather"]).content_at == 1
    assert split_tool_calls(f"{ANSWER}\n{ANSWER}\n Done.", ["get_weather"]).content_at == 2
    assert split_tool_calls(f"Checking.\n{ANSWER}\nDone.", ["get_weather"]).content_at == 0


def _stream(text: str, step: int) -> tuple[str, dict[int, dict], ToolCallParser]:
    """``text`` fed ``step`` characters at a time: content, the calls' deltas by index
    (id, name, arguments reassembled), the parser."""
    p = ToolCallParser(["get_weather"])
    content, deltas = "", []
    for i in range(0, len(text), step):
        c, d = p.feed(text[i:i + step])
        content += c
        deltas += d
    c, d = p.finish()
    content += c
    deltas += d
    by_index: dict[int, dict] = {}
    for d in deltas:
        e = by_index.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
        if d.id is not None:
            assert e["id"] is None, "id sent twice"
            e["id"], e["name"] = d.id, d.name
        e["arguments"] += d.arguments
    return content, by_index, p


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_calls_reassemble_whatever_the_chunking(step):
    text = "ok " + ANSWER + "\n" + ANSWER.replace("Paris", "Rome").replace("3", "5")
    content, by_index, p = _stream(text, step)
    assert content == "ok"
    assert sorted(by_index) == [0, 1]
    assert [json.loads(by_index[i]["arguments"]) for i in (0, 1)] == [{"city": "Paris", "days": 3},
                                                                     {"city": "Rome", "days": 5}]
    assert [c.id for c in p.calls] == [by_index[0]["id"], by_index[1]["id"]]


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_a_call_announced_and_then_not_one_keeps_its_index(step):
    # its head went out as call 0; the next call must not reuse 0 (a client would append
    # its arguments to the broken one)
    head = '{"name": "get_weather", "arguments": '
    text = f"{TOOL_OPEN}{head}{TOOL_CLOSE}{ANSWER}"
    content, by_index, p = _stream(text, step)
    assert len(p.calls) == 1
    if step < len(text):
        assert sorted(by_index) == [0, 1] and by_index[1]["id"] == p.calls[0].id
    else:      # read whole in one piece: the broken block never looked like a call
        assert sorted(by_index) == [0] and by_index[0]["id"] == p.calls[0].id
    assert json.loads(by_index[max(by_index)]["arguments"]) == {"city": "Paris", "days": 3}


def test_pages_of_spaces_in_a_call_stream_out_and_close_in_linear_time():
    # a model can be led to write them; reading the wrapper's end with a regex backtracked
    # over every run of spaces (minutes for this block), and each token rescanned them all
    spaces = "\n" + " " * 300_000
    text = (f'{TOOL_OPEN}{{"name": "get_weather", "arguments": {{"city": "Paris",{spaces}"days": 3}}'
            f'{spaces}}}{TOOL_CLOSE}')
    content, by_index, p = _stream(text, 81)
    assert content == "" and len(p.calls) == 1
    assert json.loads(by_index[0]["arguments"]) == {"city": "Paris", "days": 3}
    # spaces before the head: the block is not streamed, but read whole when it closes
    content, by_index, p = _stream(f'{TOOL_OPEN}{spaces}{text[len(TOOL_OPEN):]}', 81)
    assert content == "" and len(p.calls) == 1 and json.loads(p.calls[0].arguments)["days"] == 3
    assert by_index[0]["name"] == "get_weather"


_PIECES = [TOOL_OPEN, TOOL_CLOSE, '{"name": "get_weather", "arguments": ', '{"city": "P", "days": 3}', "}", " ",
           "\n", "x", '"', " " * 300, '{"name": "nope", "arguments": {}}', "<tool", "_call>"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=12), st.integers(1, 50))
def test_any_answer_streams_to_the_calls_it_reads_as_whole(pieces, step):
    # whatever the model writes and however it is cut into tokens: the same calls as
    # reading the answer whole, each call's streamed arguments that call's arguments, and
    # the same content (whitespace next to a call is not content); only a block announced
    # as a call and then not one differs (its pieces were sent: OpenAI's finish_reason
    # "length" case)
    text = "".join(pieces)
    content, by_index, p = _stream(text, step)
    whole_content, whole_calls, whole_at = split_tool_calls(text, ["get_weather"])
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == \
        [(c.name, json.loads(c.arguments)) for c in whole_calls]
    streamed = {e["id"]: e["arguments"] for e in by_index.values()}
    for call in p.calls:
        assert json.loads(streamed[call.id]) == json.loads(call.arguments)
    if set(streamed) == {c.id for c in p.calls}:
        assert content == whole_content
        assert (p.content_at or 0) == whole_at
    # a block's deltas, a call's or one cut short, are the same text however the answer
    # was cut (a non-streamed answer cut short reads its text in one piece); read in one
    # piece only its calls and an unclosed last block are announced, token by token
    # also a malformed block whose head came before its end
    stepped = iter([(e["name"], e["arguments"]) for e in by_index.values()])
    at_once = _stream(text, max(1, len(text)))[1]
    assert all(block in stepped for block in [(e["name"], e["arguments"]) for e in at_once.values()])


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_whitespace_next_to_a_call_is_not_content_streamed_or_whole(step):
    # a space before a call that arrives in a token of its own was streamed and the
    # whole answer's was not; now neither. The answer's own spaces stay, and text on both
    # sides of calls keeps the whitespace that stood before them.
    for text, want in [(f"  Let me check. \n{ANSWER}\n{ANSWER}\n Done. ", "  Let me check. \nDone. "),
                       (f"Let me check.\n{ANSWER}", "Let me check."),
                       (f"\n{ANSWER} \n{ANSWER}\n", ""),
                       ("No calls here.  \n", "No calls here.  \n"),
                       ("A <tool_call>{not json}</tool_call> B ", "A <tool_call>{not json}</tool_call> B ")]:
        assert split_tool_calls(text, ["get_weather"])[0] == want
        assert _stream(text, step)[0] == want


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_logprobs_keep_every_token_when_text_is_held_back(step):
    # a token whose text the reader holds back (a call's start, its block, whitespace
    # next to it) has its logprobs ride on the choice's next chunk, or on one of their
    # own at the end: the stream carries every token's, in order, as the whole answer does
    from meshnode.serve.client import Finished, TextDelta, TokenLogprob, Usage
    from meshnode.serve.openai_routes import _ChatChunks

    text = f"Let me check. \n{ANSWER}\n \n"
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    entries = [TokenLogprob(t, tuple(t.encode()), -0.5 - i) for i, t in enumerate(pieces)]
    chunks = _ChatChunks("m", False, ["get_weather"])
    chunks.logprobs = True
    out = [c for t, e in zip(pieces, entries) for c in chunks.deltas(TextDelta(t, logprobs=(e,)))]
    out += chunks.tail(Finished("stop", Usage(10, len(pieces))), [Finished("stop", Usage(10, len(pieces)))])
    streamed = [e["logprob"] for c in out for ch in c["choices"] for e in ((ch.get("logprobs") or {}).get("content") or [])]
    assert streamed == [e.logprob for e in entries]
    assert "".join(ch["delta"].get("content") or "" for c in out for ch in c["choices"]) == "Let me check."
    assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_block_nested_too_deeply_is_text_not_a_crash():
    # json recurses per nesting level: a model led to write 100,000 "[" must not fail the request
    deep = "[" * 100_000 + "]" * 100_000
    for text in (f"{TOOL_OPEN}{deep}{TOOL_CLOSE}",
                 f'{TOOL_OPEN}{{"name": "get_weather", "arguments": "{deep}"}}{TOOL_CLOSE}'):
        content, calls, _ = split_tool_calls(text, ["get_weather"])
        assert calls == [] and content == text
    assert TOOL_OPEN in format_call("get_weather", deep)   # a client's arguments, shown as they are


def test_a_call_cut_short_is_not_a_call():
    p = ToolCallParser(["get_weather"])
    p.feed(ANSWER[:50])
    p.finish()
    assert p.calls == []
    # a block cut before its call began is the text the model wrote, no closing tag added
    cut = f'{TOOL_OPEN}\n{{"name": "get_weather",'
    assert split_tool_calls(cut, ["get_weather"]) == (cut, [], 0)


# --- the request -------------------------------------------------------------------------


def _req(**kw) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return parse_request(ChatCompletionRequest, json.dumps(body).encode())


def _tool(name="get_weather", params=None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params or WEATHER.parameters}}


def test_tool_choice_decides_the_constraint():
    assert _req(tools=[_tool()]).to_generation_request("r").structure is None          # auto
    s = _req(tools=[_tool(), _tool("b")], tool_choice="required").to_generation_request("r").structure
    assert s.kind == "tool_calls" and {t.name for t in s.tools} == {"get_weather", "b"} and s.max_calls > 1
    s = _req(tools=[_tool(), _tool("b")], tool_choice={"type": "function", "function": {"name": "b"}},
             ).to_generation_request("r").structure
    assert [t.name for t in s.tools] == ["b"] and s.max_calls == 1
    s = _req(tools=[_tool()], tool_choice="required", parallel_tool_calls=False).to_generation_request("r").structure
    assert s.max_calls == 1
    assert _req(tools=[_tool()], tool_choice="none").tool_names() is None
    s = _req(response_format={"type": "json_object"}).to_generation_request("r").structure
    assert s == Structure("json", schema={"type": "object"})


@pytest.mark.parametrize("kw, param", [
    ({"tools": [_tool("bad name!")]}, "tools[0].function.name"),
    ({"tools": [_tool(), _tool()]}, "tools[1].function.name"),
    ({"tools": [_tool(params={"type": "string"})]}, "tools[0].function.parameters"),
    ({"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
])
def test_bad_tool_definitions_are_invalid_requests(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        _req(**kw).to_generation_request("r")
    assert e.value.param == param


def test_bad_shapes_name_the_field():
    with pytest.raises(InvalidRequestError) as e:
        _req(tools=[{"type": "function"}])
    assert e.value.param == "tools[0].function"
    with pytest.raises(InvalidRequestError) as e:
        _req(response_format={"type": "xml"})
    assert e.value.param == "response_format.type"


def test_allowed_tools_narrow_what_may_be_called_but_not_the_prompt():
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "b"}}]}}
    r = _req(tools=[_tool(), _tool("b")], tool_choice=allowed)
    req = r.to_generation_request("r")
    assert [t.name for t in req.tools] == ["get_weather", "b"]            # the prompt lists every tool
    assert [t.name for t in req.structure.tools] == ["b"] and r.tool_names() == ["b"]
    allowed["allowed_tools"]["mode"] = "auto"
    r = _req(tools=[_tool(), _tool("b")], tool_choice=allowed)
    assert r.to_generation_request("r").structure is None and r.tool_names() == ["b"]
    allowed["allowed_tools"]["tools"][0]["function"]["name"] = "other"
    with pytest.raises(InvalidRequestError) as e:
        _req(tools=[_tool()], tool_choice=allowed).to_generation_request("r")
    assert e.value.param == "tool_choice.allowed_tools.tools[0].function.name"


def test_legacy_functions_are_tools_of_one_call():
    fn = _tool()["function"]
    r = _req(functions=[fn, dict(fn, name="b")], function_call={"name": "b"})
    assert r.legacy_functions and r.tool_names() == ["get_weather", "b"]
    s = r.to_generation_request("r").structure
    assert [t.name for t in s.tools] == ["b"] and s.max_calls == 1
    s = _req(functions=[fn], function_call="auto").to_generation_request("r")
    assert s.structure is None and [t.name for t in s.tools] == ["get_weather"]
    assert _req(functions=[fn], function_call="none").tool_names() is None
    # tools win over functions; a function_call naming no function is the caller's mistake
    assert not _req(tools=[_tool("t")], functions=[fn]).legacy_functions
    with pytest.raises(InvalidRequestError) as e:
        _req(functions=[fn], function_call={"name": "other"}).to_generation_request("r")
    assert e.value.param == "function_call.name"


def test_a_legacy_call_and_its_result_are_a_tool_call_and_its_result():
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}},
            {"role": "function", "name": "get_weather", "content": "sunny"}]
    req = _req(messages=msgs, functions=[_tool()["function"]]).to_generation_request("r")
    call = req.messages[1].tool_calls[0]
    assert (call.name, call.arguments) == ("get_weather", "{}")
    assert req.messages[2] == ChatMessage("tool", "sunny", tool_call_id=call.id)


@pytest.mark.parametrize("stream_step", [None, 1, 7])
def test_a_legacy_answer_is_the_message_s_function_call(stream_step):
    from meshnode.serve.client import Finished, TextDelta, Usage
    from meshnode.serve.openai_routes import _ChatChunks, _Choice

    text = f"{ANSWER}\n{ANSWER}"     # a second call is not part of a legacy answer
    chunks = _ChatChunks("m", False, ["get_weather"], legacy=True)
    done = Finished("stop", Usage(10, 5))
    if stream_step is None:
        choice = _Choice()
        choice.parts, choice.finished = [text], done
        out = chunks.full_response([choice]).model_dump(mode="json", exclude_none=True)["choices"][0]
        assert out["finish_reason"] == "function_call" and "tool_calls" not in out["message"]
        call = out["message"]["function_call"]
    else:
        pieces = [text[i:i + stream_step] for i in range(0, len(text), stream_step)]
        out = [c for t in pieces for c in chunks.deltas(TextDelta(t))] + chunks.tail(done, [done])
        deltas = [ch["delta"] for c in out for ch in c["choices"]]
        assert not any("tool_calls" in d for d in deltas)
        fc = [d["function_call"] for d in deltas if "function_call" in d]
        assert [d.get("name") for d in fc] == ["get_weather"] + [None] * (len(fc) - 1)   # named once, first
        call = {"name": "get_weather", "arguments": "".join(d["arguments"] for d in fc)}
        assert [ch["finish_reason"] for c in out for ch in c["choices"] if ch.get("finish_reason")] == ["function_call"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris", "days": 3}


def test_fallback_prompt_carries_tools_calls_and_results():
    msgs = [ChatMessage("user", "weather?"),
            ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "get_weather", '{"city": "Paris", "days": 1}'),)),
            ChatMessage("tool", "sunny", tool_call_id="c1")]
    out, tools = render_messages(msgs, [WEATHER], native=False)
    assert tools is None
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert FALLBACK_TOOLS_PROMPT.split("{tools}")[0] in out[0]["content"]
    assert split_tool_calls(out[2]["content"], ["get_weather"])[1][0].arguments == '{"city": "Paris", "days": 1}'
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    native, tools = render_messages(msgs, [WEATHER], native=True)
    assert tools == [WEATHER.openai()]
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 1}
    assert native[2]["tool_call_id"] == "c1"


# --- schema -> grammar -> masks --------------------------------------------------------


def _allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.astype("<u4").view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_masks_follow_the_grammar_through_drafts(byte_tok):
    c = compile_constraint(Structure("tool_calls", tools=(WEATHER,), max_calls=2), byte_tok, "tools")
    good = list(ANSWER.encode())
    # one row per logit row of [last, d1..dk]; row i allows d(i+1)
    m = c.masks(good[:5])
    assert m.shape == (6, (257 + 31) // 32)
    for i in range(5):
        assert _allowed(m[i]) == {good[i]}       # the tag is forced, byte by byte
    # a forbidden draft: rows after it repeat the last valid row (never reached)
    bad = good[:3] + [ord("x"), ord("y")]
    m = c.masks(bad)
    assert ord("x") not in _allowed(m[3]) and (m[4] == m[3]).all() and (m[5] == m[3]).all()
    # the matcher ends where it began
    assert _allowed(c.masks()[0]) == {good[0]}
    c.commit(good)
    assert _allowed(c.masks()[0]) == {EOS, ord("\n")}   # end, or a second call
    assert c.done is False


def test_json_schema_output_is_forced_to_validate(byte_tok):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    c = compile_constraint(Structure("json", schema=schema), byte_tok, "response_format")
    # greedy over random logits under the masks always gives a valid document
    rng = np.random.default_rng(0)
    out: list[int] = []
    for _ in range(60):
        logits = rng.standard_normal((1, 257)).astype(np.float32)
        tok = int(np.argmax(apply_mask(logits, c.masks())[0]))
        if tok == EOS:
            break
        c.commit([tok])
        out.append(tok)
    doc = json.loads(bytes(out))
    assert set(doc) == {"n"} and isinstance(doc["n"], int)


def test_bad_schema_is_an_invalid_request(byte_tok):
    with pytest.raises(InvalidRequestError) as e:
        compile_constraint(Structure("json", schema={"type": "objectx"}), byte_tok, "response_format")
    assert e.value.param == "response_format" and "objectx" in e.value.message


# --- masks at the final stage ----------------------------------------------------------


def _mask_of(allowed_rows: list[set[int]], vocab: int) -> np.ndarray:
    m = np.zeros((len(allowed_rows), (vocab + 31) // 32), dtype=np.uint32)
    for r, allowed in enumerate(allowed_rows):
        for t in allowed:
            m[r, t // 32] |= np.uint32(1 << (t % 32))
    return m


def test_apply_mask_keeps_only_allowed_tokens():
    logits = np.arange(2 * 70, dtype=np.float32).reshape(2, 70)
    out = apply_mask(logits, _mask_of([{1, 33}, {69}], 70))
    assert np.isfinite(out[0]).nonzero()[0].tolist() == [1, 33] and out[0, 33] == logits[0, 33]
    assert np.isfinite(out[1]).nonzero()[0].tolist() == [69]
    with pytest.raises(ValueError):
        apply_mask(logits, _mask_of([set(), {1}], 70))


def test_logit_bias_moves_greedy_choices_and_verification_and_leaves_logprobs_raw():
    logits = np.zeros((3, 10), dtype=np.float32)
    logits[:, 4] = 5.0                       # the model's greedy choice, every row
    out = apply_bias(logits, (4, 7), (-100.0, 2.0))
    assert out[0, 4] == -95.0 and out[0, 7] == 2.0 and logits[0, 4] == 5.0   # a copy
    sampler = FinalSampler()
    plain = sampler.finalize(1, logits, (4, 4), Sampling(top_logprobs=1))
    assert plain.tokens == (4, 4, 4) and plain.n_accepted == 2
    banned = sampler.finalize(1, logits, (4, 4), Sampling(top_logprobs=1, bias_ids=(4, 7), bias_values=(-100.0, 2.0)))
    # the drafts of the banned token are rejected; the bonus is the biased argmax
    assert banned.tokens == (7,) and banned.n_accepted == 0
    # logprobs of the model's own row: the banned token is still its most likely
    assert banned.logprobs.top_ids[:1] == (4,)
    forced = sampler.finalize(1, logits, (), Sampling(temperature=1.0, seed=3, bias_ids=(9,), bias_values=(100.0,)))
    assert forced.tokens == (9,)
    with pytest.raises(ValueError, match="vocabulary"):
        sampler.finalize(1, logits, (), Sampling(bias_ids=(10,), bias_values=(1.0,)))


def test_penalties_count_the_drafts_before_each_row():
    logits = np.zeros((3, 10), dtype=np.float32)
    logits[:, 4], logits[:, 7] = 5.0, 3.0
    out = apply_penalties(logits, (4, 6), Counts((4,), (2,)), presence=0.5, frequency=1.0)
    assert out[0, 4] == 2.5 and out[1, 4] == 1.5 and out[2, 4] == 1.5 and out[2, 6] == -1.5
    assert out[0, 6] == out[1, 6] == 0.0 and out[0, 7] == 3.0
    got = FinalSampler().finalize(1, logits, (4, 4), Sampling(presence=0.5, frequency=1.0), seen=Counts((4,), (2,)))
    assert got.tokens == (7,) and got.n_accepted == 0      # the penalized 4 loses to 7 at once
    with pytest.raises(ValueError, match="vocabulary"):
        apply_penalties(logits, (), Counts((10,), (1,)), 0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 8),
       presence=st.floats(-2, 2), frequency=st.floats(-2, 2),
       before=st.dictionaries(st.integers(0, 5), st.integers(1, 4), max_size=4))
def test_a_penalized_window_verifies_what_penalized_one_row_steps_produce(seed, k, presence, frequency, before):
    """A fake model whose row t is the logits after t answer tokens: greedy one-row steps,
    counting each token, against one window drafting those same tokens."""
    rng = np.random.default_rng(seed)
    rows = (rng.integers(0, 4, size=(k + 1, 6)) + rng.random((k + 1, 6)) / 8).astype(np.float32)
    sampling = Sampling(presence=presence, frequency=frequency)
    seen = dict(before)
    plain = []
    for t in range(k + 1):
        tok = FinalSampler().finalize(1, rows[t:t + 1], (), sampling, seen=Counts.of(seen)).tokens[0]
        plain.append(tok)
        seen[tok] = seen.get(tok, 0) + 1
    window = FinalSampler().finalize(1, rows, tuple(plain[:k]), sampling, seen=Counts.of(before))
    assert window.tokens == tuple(plain) and window.n_accepted == k
    # and bit for bit: each window row is the one-row step's penalized row
    penalized = apply_penalties(rows, tuple(plain[:k]), Counts.of(before), presence, frequency)
    for i in range(k + 1):
        one = apply_penalties(rows[i:i + 1], (), Counts.of(Counter(before) + Counter(plain[:i])), presence, frequency)
        assert penalized[i].tobytes() == one[0].tobytes()


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 8), repeat=st.floats(0.1, 10),
       last_n=st.sampled_from([-1, 1, 2, 3, 5]), before=st.lists(st.integers(0, 5), max_size=6),
       frequency=st.sampled_from([0.0, 1.0]))
def test_a_repetition_penalized_window_verifies_what_one_row_steps_produce(seed, k, repeat, last_n, before, frequency):
    """As above, with the repetition penalty over a sliding window of the context (or
    all of it): each window row is bit for bit the one-row step's row."""
    rng = np.random.default_rng(seed)
    rows = (rng.integers(-3, 4, size=(k + 1, 6)) + rng.random((k + 1, 6)) / 8).astype(np.float32)
    sampling = Sampling(repeat=float(np.float32(repeat)), repeat_last_n=last_n, frequency=frequency)
    context = list(before) or [0]
    plain = []
    for t in range(k + 1):
        seen = Counts.of(Counter(plain), recent_tokens(context + plain, last_n))
        plain.append(FinalSampler().finalize(1, rows[t:t + 1], (), sampling, seen=seen).tokens[0])
    start = Counts.of({}, recent_tokens(context, last_n))
    window = FinalSampler().finalize(1, rows, tuple(plain[:k]), sampling, seen=start)
    assert window.tokens == tuple(plain) and window.n_accepted == k
    penalized = apply_repetition(rows, tuple(plain[:k]), start.recent, sampling.repeat, last_n)
    for i in range(k + 1):
        one = apply_repetition(rows[i:i + 1], (), recent_tokens(context + plain[:i], last_n), sampling.repeat, last_n)
        assert penalized[i].tobytes() == one[0].tobytes()


def test_the_repetition_penalty_divides_positive_logits_and_multiplies_the_rest():
    logits = np.array([[4.0, -4.0, 2.0, 0.0, 1.0]], dtype=np.float32)
    out = apply_repetition(logits, (), (0, 1, 3, 1), 2.0, 3)      # the window: 1, 3, 1
    assert out.tolist() == [[4.0, -8.0, 2.0, 0.0, 1.0]]
    out = apply_repetition(logits, (), (0, 1, 3), 2.0, -1)         # all of it
    assert out.tolist() == [[2.0, -8.0, 2.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="vocabulary"):
        apply_repetition(logits, (), (5,), 2.0, -1)


def test_a_draft_the_mask_forbids_is_rejected_and_the_bonus_is_allowed():
    vocab = 40
    logits = np.zeros((3, vocab), dtype=np.float32)
    logits[:, 7] = 10.0          # the model wants 7 everywhere
    drafts = (7, 7)
    sampler = FinalSampler()
    free = sampler.finalize(1, logits, drafts, Sampling())
    assert free.tokens == (7, 7, 7)
    masked = sampler.finalize(1, logits, drafts, Sampling(), _mask_of([{7}, {3, 5}, {7}], vocab))
    # row 1 forbids 7: the second draft is rejected, the bonus is the best allowed token
    assert masked.n_accepted == 1 and masked.tokens[0] == 7 and masked.tokens[1] in (3, 5)
    with pytest.raises(ValueError):
        sampler.finalize(1, logits, drafts, Sampling(), _mask_of([{7}], vocab))


# --- the frame -------------------------------------------------------------------------


def test_grammar_mask_frame_round_trips_both_forms():
    mask = _mask_of([set(range(49152)), {5}, {100, 49151}], 49152)
    msg = wire.GrammarMask.pack(3, 0xABC, mask, 49152)
    assert [r.form for r in msg.rows] == [wire.messages.MASK_BITSET, wire.messages.MASK_IDS, wire.messages.MASK_IDS]
    (back,) = wire.FrameDecoder().feed(wire.encode(msg))
    assert isinstance(back, wire.GrammarMask) and (back.unpack() == mask).all()


@pytest.mark.parametrize("rows, n_vocab", [
    ((wire.messages.MaskRow(wire.messages.MASK_IDS, np.array([70], "<u4").tobytes()),), 64),   # id past vocab
    ((wire.messages.MaskRow(wire.messages.MASK_BITSET, b"\0" * 4),), 64),                       # short bitset
    ((wire.messages.MaskRow(9, b""),), 64),                                                     # unknown form
    ((), 64),                                                                                   # no rows
    ((wire.messages.MaskRow(wire.messages.MASK_IDS, b""),) * 34, 64),                           # too many rows
    ((wire.messages.MaskRow(wire.messages.MASK_IDS, b""),), (1 << 20) + 1),                      # vocab too big
])
def test_grammar_mask_frame_bounds(rows, n_vocab):
    with pytest.raises(wire.LocalProtocolError):
        wire.encode(wire.GrammarMask(ref=0, batch_id=1, session=1, n_vocab=n_vocab, rows=rows))


def test_constraint_class_is_what_compile_returns(byte_tok):
    c = compile_constraint(Structure("json", schema={"type": "object"}), byte_tok, "response_format")
    assert isinstance(c, Constraint) and LLMatcher is not None


def test_drafts_that_end_the_grammar_leave_the_matcher_where_it_was(byte_tok):
    # an end-of-generation draft after a complete answer must not be consumed: a rollback
    # across the matcher's stop would not restore it
    c = compile_constraint(Structure("json", schema={"type": "integer"}), byte_tok, "response_format")
    c.commit([ord("4")])
    before = c.masks()[0].copy()
    m = c.masks([ord("2"), EOS, ord("x")])
    assert EOS in _allowed(m[1]) and (c.masks()[0] == before).all()
    c.commit([ord("2"), EOS])
    assert c.done
