"""The Responses API's pure parts: a body turned into the chat request it means, and the
events and response object built from an answer's text and calls."""

from __future__ import annotations

import pytest

from meshnode.serve.errors import InvalidRequestError, UnsupportedValueError
from meshnode.serve.responses_api import ResponseEvents, ResponsesRequest, usage_object
from meshnode.serve.tools import CallDelta


def _chat(**body):
    return ResponsesRequest.model_validate({"model": "m", **body}).to_chat()


def test_instructions_and_a_text_input_are_a_system_and_a_user_message():
    chat = _chat(instructions="Be brief.", input="Hi", max_output_tokens=7, temperature=0.5, seed=3)
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert (chat.max_tokens, chat.temperature, chat.seed) == (7, 0.5, 3)


def test_items_become_messages_with_one_turns_calls_in_one_message():
    chat = _chat(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
    ], tools=[{"type": "function", "name": "f"}, {"type": "function", "name": "g", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "g"})
    m = chat.messages
    assert [x.role for x in m] == ["user", "assistant", "tool", "tool"]
    assert m[0].content == "a\nb"
    assert [(c.id, c.function.name, c.function.arguments) for c in m[1].tool_calls] == \
        [("c1", "f", "{}"), ("c2", "g", "{\"x\": 1}")]
    assert (m[2].tool_call_id, m[2].content, m[3].content) == ("c1", "one", "two")
    assert [t.function.name for t in chat.tools] == ["f", "g"] and chat.tool_choice.function.name == "g"


def test_allowed_tools_are_chat_s():
    chat = _chat(input="x", tools=[{"type": "function", "name": "f"}, {"type": "function", "name": "g"}],
                 tool_choice={"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "g"}]})
    assert chat.tool_names() == ["g"] and [t.function.name for t in chat.tools] == ["f", "g"]
    assert [t.name for t in chat.to_generation_request("r").structure.tools] == ["g"]


def test_text_format_is_the_response_format():
    chat = _chat(input="x", text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"},
                                             "strict": True}})
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == {"type": "object"}
    assert _chat(input="x", text={"format": {"type": "json_object"}}).response_format.type == "json_object"
    assert _chat(input="x", text={"format": {"type": "text"}}).response_format is None


@pytest.mark.parametrize("body, error, param", [
    ({"input": "x", "tools": [{"type": "function"}]}, InvalidRequestError, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "function"}]}]},
     InvalidRequestError, "tools[0].tools[0].name"),
    ({"input": "x", "tools": [{"type": "namespace", "name": f"n{j}", "tools": [
        {"type": "function", "name": f"f{j}{i}"} for i in range(65)]} for j in range(2)]}, InvalidRequestError, "tools"),
    ({"input": [{"type": "computer_call_output"}]}, UnsupportedValueError, "input[0].type"),
    ({"input": [{"type": "message", "content": "x"}]}, InvalidRequestError, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f"}]}, InvalidRequestError, "input[0]"),
])
def test_what_cannot_be_a_chat_request_names_its_field(body, error, param):
    with pytest.raises(error) as e:
        _chat(**body)
    assert e.value.param == param


def test_a_previous_conversation_comes_between_the_instructions_and_the_input():
    previous = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."})
    chat = ResponsesRequest.model_validate({"model": "m", "instructions": "Be brief.", "input": "Again",
                                            "previous_response_id": "resp_1"}).to_chat(previous)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."), ("user", "Again")]


def _events(**body) -> ResponseEvents:
    return ResponseEvents(ResponsesRequest.model_validate({"model": "m", "input": "x", **body}), "m", "resp_1")


def test_text_then_calls_stream_as_items_in_order():
    ev = _events()
    out = ev.start() + ev.text("I will ") + ev.text("call.") + ev.call(CallDelta(0, "call_a", "f")) \
        + ev.call(CallDelta(0, arguments='{"x"')) + ev.call(CallDelta(0, arguments=": 1}")) \
        + ev.call(CallDelta(1, "call_b", "g", "{}")) + ev.finish(usage_object(10, 4, 5), None)
    kinds = [e["type"] for e in out]
    # the message stays open until the end (text may follow a call); then each item's .done, in order
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.delta",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    final = out[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "I will call."
    assert [(o["call_id"], o["arguments"]) for o in final["output"][1:]] == [("call_a", '{"x": 1}'), ("call_b", "{}")]
    # the calls' output_index: after the message
    assert [e["output_index"] for e in out if e["type"] == "response.function_call_arguments.done"] == [1, 2]
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 4 and final["usage"]["total_tokens"] == 15


@pytest.mark.parametrize("before", ["", "Checking. "])
def test_text_after_a_call_streams_and_the_final_output_is_the_stream(before):
    """Text after a call continues the message (or, when the answer began with the call,
    is a message after it): the deltas add up to the final object's text, and each
    item's output_index is its place in the final output."""
    ev = _events()
    out = ev.start() + (ev.text(before) if before else []) + ev.call(CallDelta(0, "call_a", "f", "{}")) \
        + ev.text("Done.") + ev.finish(usage_object(3, 0, 4), None)
    final = out[-1]["response"]["output"]
    assert [o["type"] for o in final] == (["message", "function_call"] if before else ["function_call", "message"])
    [message] = [o for o in final if o["type"] == "message"]
    deltas = "".join(e["delta"] for e in out if e["type"] == "response.output_text.delta")
    assert deltas == message["content"][0]["text"] == before + "Done."
    for e in out:
        if "output_index" in e:
            want = next(i for i, o in enumerate(final) if o["id"] == (e.get("item_id") or e["item"]["id"]))
            assert e["output_index"] == want, e
    assert ev.assistant_message() == {"role": "assistant", "content": before + "Done.", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize("before", ["", "Checking. "])
def test_a_whole_answer_lists_its_items_as_its_stream_does(before):
    """The non-streamed response object's output equals the stream's final one: a text
    after a call is a message after that call."""
    from meshnode.serve.tools import split_tool_calls

    answer = f'{before}<tool_call>\n{{"name": "f", "arguments": {{}}}}\n</tool_call>\nDone.'
    content, calls, at = split_tool_calls(answer, ["f"])
    ev = _events()
    ev.set_calls(calls)
    ev.set_text(content, at=at)
    whole = ev.response("completed", usage_object(3, 0, 4))["output"]
    assert [o["type"] for o in whole] == (["message", "function_call"] if before else ["function_call", "message"])
    assert whole[at]["content"][0]["text"] == f"{before}Done."


def _cut_answer(text: str, *, stream: bool, pieces: int = 3):
    """The output items of a Responses answer with tool f cut short at ``text``, as
    the stream's last event has them or as the non-streamed response object."""
    from meshnode.serve.client import Finished, TextDelta, Usage
    from meshnode.serve.openai_routes import _Choice, _ResponsesChunks

    body = ResponsesRequest.model_validate({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f"}]})
    chunks = _ResponsesChunks(body, ["f"])
    end = Finished("length", Usage(3, 9))
    if stream:
        step = max(1, len(text) // pieces)
        for i in range(0, len(text), step):
            chunks.deltas(TextDelta(text[i:i + step]))
        r = chunks.tail(end, [end])[-1]["response"]
    else:
        choice = _Choice()
        choice.parts, choice.finished = [text], end
        r = chunks.full_response([choice]).model_dump(mode="json")
    assert r["status"] == "incomplete"
    return [(o["type"], o["status"], o.get("name"), o.get("arguments"),
             o["content"][0]["text"] if o["type"] == "message" else None) for o in r["output"]]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": "lo',          # cut in the arguments
    'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a',  # after some text
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "f", "arg',  # a second call
    '<tool_call>\n{"name": "f", "argu',                          # before the call was announced
    '<tool_call>\n{"name": "g", "arguments": {',                 # not one of its tools
    'Just text, cut sho',
])
def test_an_answer_cut_short_has_the_same_items_streamed_or_not(text):
    whole = _cut_answer(text, stream=False)
    assert whole == _cut_answer(text, stream=True) == _cut_answer(text, stream=True, pieces=len(text))
    assert whole[-1][1] == "incomplete" and all(o[1] == "completed" for o in whole[:-1])


def test_a_call_cut_short_is_an_incomplete_call_once_announced_else_the_text():
    assert _cut_answer('<tool_call>\n{"name": "f", "arguments": {"a": "lo', stream=False) == \
        [("function_call", "incomplete", "f", '{"a": "lo', None)]
    # not a call yet when it stopped: the text the model wrote (not an empty message)
    text = '<tool_call>\n{"name": "f", "argu'
    assert _cut_answer(text, stream=False) == [("message", "incomplete", None, None, text)]


def test_an_answer_cut_short_is_incomplete_and_an_empty_one_is_an_empty_message():
    ev = _events(max_output_tokens=3)
    out = ev.start() + ev.finish(usage_object(1, 0, 3), "max_output_tokens")
    assert out[-1]["type"] == "response.incomplete"
    r = out[-1]["response"]
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [o["type"] for o in r["output"]] == ["message"] and r["output"][0]["content"][0]["text"] == ""
    assert "response.output_item.added" in [e["type"] for e in out]
    # the item being written when the answer stopped is incomplete, in the stream and the response
    assert r["output"][0]["status"] == "incomplete"
    assert [e["item"]["status"] for e in out if e["type"] == "response.output_item.done"] == ["incomplete"]


def test_only_the_last_item_of_an_answer_cut_short_is_incomplete():
    ev = _events(max_output_tokens=9)
    out = ev.start() + ev.text("Checking.") + ev.call(CallDelta(0, "call_a", "f", '{"x": ')) \
        + ev.finish(usage_object(3, 0, 9), "max_output_tokens")
    assert [(o["type"], o["status"]) for o in out[-1]["response"]["output"]] == \
        [("message", "completed"), ("function_call", "incomplete")]
    assert [e["item"]["status"] for e in out if e["type"] == "response.output_item.done"] == ["completed", "incomplete"]


def test_namespaces_offer_their_functions_and_hosted_tools_are_left_out():
    body = {"input": "x", "tools": [{"type": "web_search"}, {"type": "function", "name": "f"},
                                    {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "spawn"}]},
                                    {"type": "custom", "name": "apply_patch"}]}
    chat = _chat(**body)
    assert [t.function.name for t in chat.tools] == ["f", "spawn"]
    ev = _events(**{k: v for k, v in body.items() if k != "input"})
    ev.call(CallDelta(0, "c1", "spawn", "{}"))
    ev.call(CallDelta(1, "c2", "f", "{}"))
    items = ev.finish(usage_object(1, 0, 1), None)[-1]["response"]["output"]
    assert [i.get("namespace") for i in items] == ["agents", None]
