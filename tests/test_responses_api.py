"""OpenAI's Responses API end to end: a real node process (real HTTP, llama.cpp on
SmolLM2) driven by the official openai client's ``responses.create``. Each answer is the
chat completion the same conversation gives (greedy), streamed or not; tool calls come
back as function_call items and go in again as input items; ``text.format`` constrains
the answer; a kept answer continues with ``previous_response_id`` as the whole
conversation would; what the node cannot do is a 400 naming the field. Through a member that
holds no model: tests/test_mesh_endpoint.py."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from tests.test_split_serving import solo_node

pytestmark = [pytest.mark.slow, pytest.mark.net]

QUESTION = "Name three colours."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def node(smollm2, tmp_path_factory):
    with solo_node(tmp_path_factory.mktemp("responses"), smollm2.path) as proc:
        client = OpenAI(base_url=f"http://127.0.0.1:{proc.info['http_port']}/v1", api_key="none", max_retries=0)
        yield proc, client, client.models.list().data[0].id


def _chat(client: OpenAI, model: str, messages: list[dict], max_tokens: int, **kw):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kw)


def test_an_answer_is_the_chat_completion_of_the_same_conversation(node):
    _, client, model = node
    chat = _chat(client, model, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}], 40)
    args = dict(model=model, instructions="Be brief.", input=QUESTION, max_output_tokens=40, temperature=0)
    r = client.responses.create(**args)
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert r.id.startswith("resp_") and chat.id.startswith("chatcmpl-")
    # streamed: the typed events, in order, numbered, adding up to the same text
    events = list(client.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{r.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == events[-1].response.output_text == r.output_text
    # the same conversation as message items, the text as input_text parts
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    again = client.responses.create(model=model, instructions="Be brief.", input=items, max_output_tokens=40,
                                    temperature=0)
    assert again.output_text == r.output_text


def test_output_text_logprobs_are_chats(node):
    _, client, model = node
    chat = _chat(client, model, [{"role": "user", "content": QUESTION}], 12, logprobs=True, top_logprobs=2)
    args = dict(model=model, input=QUESTION, max_output_tokens=12, temperature=0, top_logprobs=2,
                include=["message.output_text.logprobs"])
    r = client.responses.create(**args)
    got = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in r.output[0].content[0].logprobs]
    want = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in chat.choices[0].logprobs.content]
    assert got == want and len(got) == r.usage.output_tokens
    events = list(client.responses.create(**args, stream=True))
    streamed = [(e.token, e.logprob) for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    assert streamed == [(t, lp) for t, lp, _ in want]
    # not asked for: none
    assert client.responses.create(**{**args, "include": None}).output[0].content[0].logprobs == []
    # with tools the text is read for calls first; a text answer's logprobs are still chat's
    tool = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    chat = _chat(client, model, [{"role": "user", "content": QUESTION}], 12, logprobs=True, top_logprobs=2,
                 tools=[tool])
    assert not chat.choices[0].message.tool_calls and chat.choices[0].message.content
    want = [(e.token, e.logprob) for e in chat.choices[0].logprobs.content]
    with_tools = client.responses.create(**args, tools=[WEATHER])
    assert with_tools.output_text == chat.choices[0].message.content
    assert [(e.token, e.logprob) for e in with_tools.output[0].content[0].logprobs] == want
    events = list(client.responses.create(**args, tools=[WEATHER], stream=True))
    assert [(e.token, e.logprob) for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs] == want


def test_a_tool_call_goes_out_and_its_output_comes_back_in(node):
    _, client, model = node
    question = "What is the weather in Paris?"
    args = dict(model=model, input=question, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                temperature=0)
    r = client.responses.create(**args)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id and calls[0].status == "completed"
    assert isinstance(json.loads(calls[0].arguments), dict)
    # the chat completion of the same conversation calls the same function with the same arguments
    chat = _chat(client, model, [{"role": "user", "content": question}], 256,
                 tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
                 tool_choice="required", parallel_tool_calls=False)
    assert [(c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls] == \
        [(c.name, c.arguments) for c in calls]
    # streamed: each call an item whose arguments stream, done with the arguments read back
    events = list(client.responses.create(**args, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert added[0].item.type == "function_call" and added[0].item.name == "get_weather"
    assert [d.arguments for d in done] == [c.arguments for c in calls]
    assert events[-1].type == "response.completed"
    # the call and its output as input items: the answer is chat's to the same messages
    follow = [{"role": "user", "content": question},
              {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
               "arguments": calls[0].arguments},
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C"}]
    answer = client.responses.create(model=model, input=follow, tools=[WEATHER], max_output_tokens=24, temperature=0)
    chat = _chat(client, model, [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny, 24 C"}], 24,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.output_text == (chat.choices[0].message.content or "")


def test_namespaced_functions_are_offered_and_hosted_tools_left_out(node):
    _, client, model = node
    tools = [{"type": "web_search", "external_web_access": False},
             {"type": "namespace", "name": "weather", "description": "Weather tools", "tools": [WEATHER]}]
    r = client.responses.create(model=model, input="What is the weather in Paris?", tools=tools,
                                tool_choice="required", parallel_tool_calls=False, temperature=0)
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.namespace == "weather"
    assert [t.type for t in r.tools] == ["web_search", "namespace"]


def test_text_format_constrains_the_answer(node):
    _, client, model = node
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"],
              "additionalProperties": False}
    r = client.responses.create(model=model, input="Give one colour as JSON.", temperature=0, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "c", "schema": schema, "strict": True}})
    assert set(json.loads(r.output_text)) == {"colour"}
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("extra, param", [
    ({"background": True}, "background"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_the_node_cannot_do_is_a_400_naming_the_field(node, extra, param):
    proc, client, model = node
    r = httpx.post(f"http://127.0.0.1:{proc.info['http_port']}/v1/responses",
                   json={"model": model, "input": "hi", **extra}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(BadRequestError):
        client.responses.create(model=model, **{"input": "hi", **extra})


def test_previous_response_id_continues_the_conversation_kept_on_the_node(node):
    proc, client, model = node
    first = client.responses.create(model=model, instructions="Be brief.", input=QUESTION, max_output_tokens=24,
                                    temperature=0)
    assert first.store is True and first.previous_response_id is None
    follow = "Now name one more."
    # the next turn alone, after the kept answer: the chat of the whole conversation
    chat = _chat(client, model, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": follow}], 24)
    second = client.responses.create(model=model, instructions="Be brief.", input=follow, max_output_tokens=24,
                                     temperature=0, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # streamed, a third turn after the second (the conversation grows turn by turn)
    events = list(client.responses.create(model=model, input="Thanks.", max_output_tokens=8, temperature=0,
                                          previous_response_id=second.id, stream=True))
    third = events[-1].response
    chat3 = _chat(client, model, [{"role": "user", "content": QUESTION},
                                  {"role": "assistant", "content": first.output_text},
                                  {"role": "user", "content": follow},
                                  {"role": "assistant", "content": second.output_text},
                                  {"role": "user", "content": "Thanks."}], 8)
    assert third.output_text == chat3.choices[0].message.content
    # kept answers come back by id and can be deleted; store false keeps nothing
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(second.id)
    unkept = client.responses.create(model=model, input=QUESTION, max_output_tokens=4, store=False)
    assert unkept.store is False
    for rid in (unkept.id, "resp_nothing"):
        r = httpx.post(f"http://127.0.0.1:{proc.info['http_port']}/v1/responses",
                       json={"model": model, "input": "hi", "previous_response_id": rid}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text


def test_a_restarted_node_still_continues_a_kept_response(smollm2, tmp_path):
    """Kept answers live on disk (responses.sqlite3 in the node's data folder): the same
    home started again continues them; with --keep-responses memory it forgets them."""
    args = dict(instructions="Be brief.", max_output_tokens=12, temperature=0)
    with solo_node(tmp_path, smollm2.path) as proc:
        client = OpenAI(base_url=f"http://127.0.0.1:{proc.info['http_port']}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        first = client.responses.create(model=model, input=QUESTION, **args)
        gone = client.responses.create(model=model, input="Say hi.", **args)
        client.responses.delete(gone.id)
        before = client.responses.create(model=model, input="One more.", previous_response_id=first.id, **args)
    with solo_node(tmp_path, smollm2.path) as proc:
        client = OpenAI(base_url=f"http://127.0.0.1:{proc.info['http_port']}/v1", api_key="none", max_retries=0)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        after = client.responses.create(model=model, input="One more.", previous_response_id=first.id, **args)
        assert after.output_text == before.output_text       # the same conversation, greedy
        with pytest.raises(NotFoundError):
            client.responses.retrieve(gone.id)               # deleted stays deleted
    with solo_node(tmp_path, smollm2.path, "--keep-responses", "memory") as proc:
        client = OpenAI(base_url=f"http://127.0.0.1:{proc.info['http_port']}/v1", api_key="none", max_retries=0)
        with pytest.raises(NotFoundError):
            client.responses.retrieve(first.id)
