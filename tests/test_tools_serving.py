"""Tools and structured output against real nodes (real llama.cpp on SmolLM2, real HTTP,
the official openai client, langchain-openai and litellm): every tool call and every structured
answer parses and validates against its schema, streamed and not; constrained greedy
output is the same with n-gram speculation on and off, and on a 2-stage split (masks
computed at stage 0, applied at the final stage) as on one node.

SmolLM2's chat template does not render tools, so these run the fallback prompt format
(docs/api.md, "Tools and structured output"). A 135M model makes poor tool choices;
what is checked is the protocol."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema_rs
import pytest

from meshnode.bench.cluster import link_model
from tests.nodeproc import meshnode_cmd, start_node
from tests.test_split_serving import _wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.net]

FLAGS = ("--threads", "1", "--ctx", "1024", "--batch", "64", "--parallel", "2")
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                  "required": ["city", "days"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
               "required": ["timezone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast of a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "The current time in a timezone",
                                      "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                       "maxItems": 3}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


def _home(root: Path, name: str, model: Path) -> Path:
    home = root / name
    link_model(home, model)
    return home


def _client(node):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{node.info['http_port']}/v1", api_key="none", max_retries=0)


def _valid_call(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema_rs.validate(SCHEMAS[call.function.name], args)
    assert call.id.startswith("call_") and call.type == "function"
    return args


@pytest.fixture(scope="module")
def node(smollm2, tmp_path_factory):
    """One node, n-gram speculation on (constrained steps verify drafts under masks)."""
    home = _home(tmp_path_factory.mktemp("tools"), "solo", smollm2.path)
    n = start_node(home, "solo", "--model", str(smollm2.path), "--spec", "ngram", "--spec-mode", "on", *FLAGS)
    try:
        n.wait_up(30)
        _wait_ready(n)
        yield n
    finally:
        n.stop()


@pytest.fixture(scope="module")
def client(node):
    c = _client(node)
    c.model_id = c.models.list().data[0].id
    return c


def test_tool_calling_loop(client):
    r = client.chat.completions.create(model=client.model_id, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    _valid_call(call)
    # the result goes back; the model answers in text
    messages = ASK + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny, 21 C"})}]
    r2 = client.chat.completions.create(model=client.model_id, messages=messages, tools=TOOLS, tool_choice="none",
                                        temperature=0, max_tokens=40)
    assert r2.choices[0].message.tool_calls is None
    assert r2.choices[0].message.content and r2.choices[0].finish_reason in ("stop", "length")
    # the tool result reached the prompt: it is longer than the first turn's by more than the answer
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_tool_calls_have_openai_delta_shape(client):
    stream = client.chat.completions.create(model=client.model_id, messages=ASK, tools=TOOLS, tool_choice="required",
                                            temperature=0, max_tokens=200, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        for d in ch.delta.tool_calls or []:
            if d.index not in calls:
                # the first delta of a call names it, once
                assert d.id and d.type == "function" and d.function.name, d
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.id is None and d.function.name is None, d
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert calls and sorted(calls) == list(range(len(calls)))
    complete = calls if finish == "tool_calls" else {i: c for i, c in calls.items() if i < len(calls) - 1}
    assert finish in ("tool_calls", "length") and complete
    for c in complete.values():
        jsonschema_rs.validate(SCHEMAS[c["name"]], json.loads(c["arguments"]))


def test_legacy_functions_loop(client):
    # OpenAI's deprecated spelling, as older clients send it: the call is the message's
    # function_call, streamed or not, and its result comes back as a role "function" message
    functions = [t["function"] for t in TOOLS]
    args = dict(model=client.model_id, messages=ASK, functions=functions, function_call={"name": "get_weather"},
                temperature=0, max_tokens=120)
    r = client.chat.completions.create(**args)
    choice = r.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    call = choice.message.function_call
    assert call.name == "get_weather"
    jsonschema_rs.validate(WEATHER_PARAMS, json.loads(call.arguments))
    streamed = {"name": None, "arguments": ""}
    finish = None
    for chunk in client.chat.completions.create(**args, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            if ch.delta.function_call is not None:
                streamed["name"] = streamed["name"] or ch.delta.function_call.name
                streamed["arguments"] += ch.delta.function_call.arguments or ""
    # (the streamed arguments are the text as it came; the whole answer's are read back)
    assert finish == "function_call" and streamed["name"] == call.name
    assert json.loads(streamed["arguments"]) == json.loads(call.arguments)
    messages = ASK + [choice.message.model_dump(exclude_none=True),
                      {"role": "function", "name": "get_weather", "content": json.dumps({"forecast": "sunny"})}]
    r2 = client.chat.completions.create(model=client.model_id, messages=messages, functions=functions,
                                        function_call="none", temperature=0, max_tokens=20)
    assert r2.choices[0].message.function_call is None and r2.choices[0].message.content
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("seed", [1, 2])
def test_named_tool_choice_is_always_a_valid_call_of_that_tool(client, seed):
    # sampled, not greedy: whatever the model picks, the grammar keeps it valid
    r = client.chat.completions.create(
        model=client.model_id, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    _valid_call(call)


def test_allowed_tools_keep_every_tool_in_the_prompt_and_call_only_those(client):
    named = client.chat.completions.create(model=client.model_id, messages=ASK, tools=TOOLS, temperature=0,
                                           max_tokens=80, tool_choice={"type": "function", "function": {"name": "get_time"}})
    r = client.chat.completions.create(
        model=client.model_id, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80, parallel_tool_calls=False,
        tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
            {"type": "function", "function": {"name": "get_time"}}]}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    _valid_call(call)
    # the same prompt (every tool listed) as a named choice of it, and so the same call
    assert r.usage.prompt_tokens == named.usage.prompt_tokens
    assert call.function.arguments == named.choices[0].message.tool_calls[0].function.arguments


def test_json_schema_and_json_object_outputs_validate(client):
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=client.model_id, messages=[{"role": "user", "content": "Invent a person."}], temperature=0.8,
            seed=seed, max_tokens=150,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                    "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema_rs.validate(PERSON, json.loads(r.choices[0].message.content))
    r = client.chat.completions.create(model=client.model_id, messages=[{"role": "user", "content": "A JSON list "
                                       "of two colours, as an object."}], temperature=0, max_tokens=100,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_parse_with_a_pydantic_model(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)
        # a float's digits are unbounded: a small model may write them until max_tokens
        population_millions: int = Field(ge=0, le=100)

    r = client.beta.chat.completions.parse(model=client.model_id, messages=[{"role": "user", "content":
                                           "Describe Paris."}], response_format=City, temperature=0, max_tokens=150)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_bad_tool_definitions_and_schemas_are_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=client.model_id, messages=ASK, tool_choice="required", tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
                "x": {"type": "no-such-type"}}}}}])
    assert e.value.body["param"] == "tools" and "no-such-type" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=client.model_id, messages=ASK, tools=[
            {"type": "function", "function": {"name": "has space"}}])
    assert e.value.body["param"] == "tools[0].function.name"


def test_langchain_openai_makes_a_tool_call(node):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, days: int) -> str:
        """The weather forecast of a city."""
        return "sunny"

    model_id = _client(node).models.list().data[0].id
    llm = ChatOpenAI(base_url=f"http://127.0.0.1:{node.info['http_port']}/v1", api_key="none", model=model_id,
                     temperature=0, max_tokens=100, max_retries=0)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Rome for 2 days?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    assert set(call["args"]) == {"city", "days"} and isinstance(call["args"]["days"], int)


# --- the same constrained tokens: speculation off, and a 2-stage split -------------------

def _constrained_outputs(c) -> list[str]:
    """Greedy constrained answers, as text (a call's name and arguments, or JSON)."""
    model = c.models.list().data[0].id
    out = []
    r = c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, temperature=0, max_tokens=80)
    out.append(json.dumps([(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]))
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Invent a person."}],
                                  temperature=0, max_tokens=150, response_format={
                                      "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    out.append(r.choices[0].message.content)
    stream = c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       stream=True)
    deltas = [d for ch in stream if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    # the streamed call: named once in its first delta, its argument pieces reassemble
    # into arguments that parse and match the schema
    assert deltas and deltas[0].index == 0 and deltas[0].id and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema_rs.validate(WEATHER_PARAMS, json.loads(arguments))
    out.append(arguments)
    return out


def _litellm_call(node, *, stream: bool) -> dict:
    """A named tool call through litellm's OpenAI-compatible provider, as aider sends it
    (``openai/<model>`` with ``api_base``); returns the call's parsed arguments."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no fetch of its price list at import
    import litellm

    model = _client(node).models.list().data[0].id
    kwargs = dict(model=f"openai/{model}", api_base=f"http://127.0.0.1:{node.info['http_port']}/v1",
                  api_key="none", messages=ASK, tools=TOOLS, temperature=0, max_tokens=80, num_retries=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if not stream:
        r = litellm.completion(**kwargs)
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and call.id
        arguments = call.function.arguments
    else:
        chunks = list(litellm.completion(**kwargs, stream=True))
        r = litellm.stream_chunk_builder(chunks, messages=ASK)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and call.id
        arguments = call.function.arguments
    args = json.loads(arguments)
    jsonschema_rs.validate(WEATHER_PARAMS, args)
    return args


def test_litellm_makes_a_tool_call(node):
    assert _litellm_call(node, stream=False) == _litellm_call(node, stream=True)


def test_constrained_output_is_the_same_without_speculation_and_on_a_split(smollm2, node, client, tmp_path):
    with_spec = _constrained_outputs(client)
    litellm_args = _litellm_call(node, stream=True)
    for text in with_spec[:2]:
        json.loads(text)
    root = tmp_path
    solo = start_node(_home(root, "plain", smollm2.path), "plain", "--model", str(smollm2.path),
                      "--spec-mode", "off", *FLAGS)
    try:
        solo.wait_up(30)
        _wait_ready(solo)
        assert _constrained_outputs(_client(solo)) == with_spec
    finally:
        solo.stop()
    homes = [_home(root, n, smollm2.path) for n in ("s0", "s1")]
    tok = meshnode_cmd("invite", "--home", str(homes[0])).stdout.strip().splitlines()[-1]
    assert meshnode_cmd("join", tok, "--home", str(homes[1])).returncode == 0
    helper = start_node(homes[1], "s1", "--no-model", *FLAGS)
    coord = None
    try:
        helper.wait_up(30)
        coord = start_node(homes[0], "s0", "--model", str(smollm2.path), "--split", "2", "--spec", "ngram",
                           "--spec-mode", "on", *FLAGS).wait_up(30)
        _wait_ready(coord)
        assert [s["state"] for s in coord.status()["stages"]] == ["ready", "ready"]
        assert _constrained_outputs(_client(coord)) == with_spec
        # litellm (aider's client) streaming a call through the split
        assert _litellm_call(coord, stream=True) == litellm_args
    except BaseException:
        for n in (coord, helper):
            if n is not None:
                print(n.log()[-4000:])
        raise
    finally:
        for n in (coord, helper):
            if n is not None:
                n.stop()
