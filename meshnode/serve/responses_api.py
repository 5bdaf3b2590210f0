"""OpenAI's Responses API (``POST /v1/responses``) over the chat machinery.

Theory of operation. A Responses body is a conversation in another shape: ``input`` (a
text, or items: messages, the function calls an earlier answer made and their outputs),
``instructions``, flat function ``tools`` and ``text.format``. :meth:`ResponsesRequest.to_chat`
turns it into the :class:`~meshnode.serve.schemas.ChatCompletionRequest` it means, so the
prompt, the tool calls read back from the answer and structured output are exactly a
chat completion's. :class:`ResponseEvents` (sans-IO) builds what goes back: the
``response`` object, and for a stream the typed events (``response.created``, the
message's ``response.output_text.delta`` s, each call's ``function_call`` item with its
arguments, ``response.completed``), each numbered by ``sequence_number``.

An answer whose body does not say ``store: false`` is kept (serve/response_store.py,
bounded, memory only): a later body naming it in ``previous_response_id`` continues
that conversation (its messages, then this body's input), and ``GET /v1/responses/{id}``
gives it back. ``background`` is refused. Function
tools may come grouped in ``namespace`` tools (Codex CLI sends its sub-agent tools so): a
call of one is a ``function_call`` item naming its namespace. Tools that OpenAI's
servers run themselves (web search, file search, code interpreter, ...) and custom
tools are not offered to the model: it answers without them (an agent that sends them
among its function tools still works; the log says which were left out).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from meshnode.serve.client import TokenLogprob, ToolCall
from meshnode.serve.errors import InvalidRequestError, UnsupportedValueError
from meshnode.limits import MAX_TOP_LOGPROBS
from meshnode.serve.schemas import (
    MAX_CONTENT_PARTS, MAX_MESSAGES, SEED_MAX, SEED_MIN, ChatCompletionRequest, ChatLogprobs, _Lenient,
)
from meshnode.serve.tools import MAX_TOOLS, CallDelta

log = logging.getLogger(__name__)

# the text parts of a message item: what a user or system wrote, what the assistant said
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
# the ``include`` value that asks for the output text's logprobs
INCLUDE_LOGPROBS = "message.output_text.logprobs"


class InputPart(_Lenient):
    type: str
    text: str | None = None


class InputItem(_Lenient):
    """One item of ``input``: a message (``type`` "message", or absent with a ``role``), a
    ``function_call`` an earlier answer made, or its ``function_call_output``."""

    type: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | Annotated[list[InputPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    call_id: str | None = Field(default=None, max_length=256)
    name: str | None = Field(default=None, max_length=256)
    arguments: str | None = None
    output: str | Annotated[list[InputPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None


class ResponsesTool(_Lenient):
    type: str
    name: str | None = Field(default=None, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: Annotated[list[ResponsesTool], Field(max_length=MAX_TOOLS)] | None = None   # a namespace's

    def functions(self, param: str) -> list[tuple[str, ResponsesTool, str | None]]:
        """The function tools this one offers the model: (param, tool, namespace)."""
        if self.type == "function":
            return [(param, self, None)]
        if self.type == "namespace":
            return [(f"{param}.tools[{j}]", t, self.name) for j, t in enumerate(self.tools or [])
                    if t.type == "function"]
        return []


class FunctionChoice(_Lenient):
    type: Literal["function"]
    name: str = Field(max_length=256)


class AllowedToolsChoice(_Lenient):
    """Every tool in the prompt, only these callable (chat's ``allowed_tools``)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: Annotated[list[FunctionChoice], Field(min_length=1, max_length=MAX_TOOLS)]


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Lenient):
    format: TextFormat | None = None


class ResponsesRequest(_Lenient):
    model: str = Field(min_length=1)
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)   # (not OpenAI's: chat's)
    stream: bool | None = False
    tools: Annotated[list[ResponsesTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | AllowedToolsChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: Annotated[list[str], Field(max_length=64)] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def logprobs(self) -> bool:
        """Whether the output text's logprobs were asked for (``include``)."""
        return INCLUDE_LOGPROBS in (self.include or [])

    @field_validator("input", mode="before")
    @classmethod
    def _not_empty(cls, v: Any) -> Any:
        # said here: past the bound, the union's error would name its first branch
        if isinstance(v, list) and not v:
            raise ValueError("an empty list of input items")
        if isinstance(v, list) and len(v) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} input items")
        return v

    def to_chat(self, previous: Sequence[dict[str, Any]] = ()) -> ChatCompletionRequest:
        """The chat completion this body asks for, after the chat messages ``previous``
        (the conversation of ``previous_response_id``); raises InvalidRequestError or
        UnsupportedValueError (naming this body's fields) for what it cannot be."""
        if self.background:
            raise UnsupportedValueError("background", "Background responses are not supported.")
        messages = [*([{"role": "system", "content": self.instructions}] if self.instructions else []),
                    *previous, *self.conversation()]
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": bool(self.stream)}
        for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p"), ("seed", "seed"), ("parallel_tool_calls", "parallel_tool_calls"),
                             ("user", "user")):
            if getattr(self, ours) is not None:
                body[theirs] = getattr(self, ours)
        if self.logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        functions = self.functions()
        left_out = sorted({t.type for t in self.tools or [] if t.type not in ("function", "namespace")})
        if left_out:
            log.info("responses: tools not offered to the model (this node runs no hosted tools): %s",
                     ", ".join(left_out))
        if functions:
            body["tools"] = [_chat_tool(param, t) for param, t, _ in functions]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif isinstance(self.tool_choice, AllowedToolsChoice):
            body["tool_choice"] = {"type": "allowed_tools", "allowed_tools": {
                "mode": self.tool_choice.mode,
                "tools": [{"type": "function", "function": {"name": t.name}} for t in self.tool_choice.tools]}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise InvalidRequestError("input", f"Invalid conversation: {e.errors(include_url=False)[0]['msg']}.") \
                from None

    def functions(self) -> list[tuple[str, ResponsesTool, str | None]]:
        """The function tools offered to the model, namespaces' included: (param, tool,
        namespace); at most MAX_TOOLS of them."""
        out = [f for i, t in enumerate(self.tools or []) for f in t.functions(f"tools[{i}]")]
        if len(out) > MAX_TOOLS:
            raise InvalidRequestError("tools", f"{len(out)} function tools (namespaces' included); at most "
                                      f"{MAX_TOOLS}.")
        return out

    def namespaces(self) -> dict[str, str]:
        """Function name -> the namespace it came in, for the calls' items."""
        return {t.name: ns for _, t, ns in self.functions() if ns is not None and t.name}

    def conversation(self) -> list[dict[str, Any]]:
        """``input`` as chat messages (the instructions are not part of it)."""
        out: list[dict[str, Any]] = []
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.type or ("message" if item.role is not None else None)
            if kind == "message":
                if item.role is None:
                    raise InvalidRequestError(f"input[{i}].role", "A message item needs a 'role'.")
                out.append({"role": item.role, "content": _text(item.content, f"input[{i}].content")})
            elif kind == "function_call":
                if not item.call_id or not item.name:
                    raise InvalidRequestError(f"input[{i}]", "A function_call item needs 'call_id' and 'name'.")
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments or ""}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":   # one turn's calls: one message
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                if not item.call_id:
                    raise InvalidRequestError(f"input[{i}].call_id", "A function_call_output item needs 'call_id'.")
                out.append({"role": "tool", "tool_call_id": item.call_id,
                            "content": _text(item.output, f"input[{i}].output")})
            elif kind == "reasoning":
                continue    # another model's reasoning: nothing this one reads
            else:
                raise UnsupportedValueError(f"input[{i}].type", f"Input items of type {kind!r} are not supported; "
                                            "messages, function_call and function_call_output are.")
        return out


def _text(content: str | list[InputPart] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise UnsupportedValueError(f"{param}[{j}].type", f"Content part type {part.type!r} is not supported; "
                                        "only text parts are.")
        texts.append(part.text)
    return "\n".join(texts)


def _chat_tool(param: str, t: ResponsesTool) -> dict[str, Any]:
    if not t.name:
        raise InvalidRequestError(f"{param}.name", "A function tool needs a 'name'.")
    return {"type": "function", "function": {"name": t.name, "description": t.description,
                                             "parameters": t.parameters, "strict": t.strict}}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseEvents:
    """The ``response`` object and the stream's events of one answer (sans-IO): feed it
    content text (:meth:`text`) and call pieces (:meth:`call`) in order, then
    :meth:`finish`."""

    def __init__(self, request: ResponsesRequest, model: str, response_id: str | None = None) -> None:
        self.request = request
        self.model = model
        self.id = response_id or _new_id("resp")
        self.created_at = int(time.time())
        self._seq = 0
        self._message_id: str | None = None      # the message item, once content came
        self._content: list[str] = []
        self._logprobs: list[dict[str, Any]] = []     # the output text's, when asked for
        self._calls: dict[int, dict[str, Any]] = {}   # call index -> its function_call item
        # the output items in the order a stream added them: None the message, else a
        # call's index (a text after a call adds the message after it when none came before)
        self._order: list[int | None] = []
        self._namespaces = request.namespaces()

    # -- the response object --------------------------------------------------------------

    def response(self, status: str = "in_progress", usage: dict[str, Any] | None = None,
                 incomplete: str | None = None) -> dict[str, Any]:
        r = self.request
        fmt = r.text.format if r.text is not None and r.text.format is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
            "output": self.output(cut=status == "incomplete") if status != "in_progress" else [],
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": r.store is not False,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": (r.tool_choice.model_dump() if isinstance(r.tool_choice, (FunctionChoice, AllowedToolsChoice))
                            else r.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": "disabled",
            "usage": usage, "user": r.user, "metadata": r.metadata or {},
        }

    def output(self, cut: bool = False) -> list[dict[str, Any]]:
        """The output items (``cut``: the answer stopped at max_output_tokens, in its last item)."""
        items = [self._message("completed") if key is None else dict(self._calls[key], status="completed")
                 for key in self._order]
        if cut and items:
            items[-1]["status"] = "incomplete"
        return items

    def _message(self, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self._part("".join(self._content), self._logprobs)]
        if self._message_id is None:
            self._message_id = _new_id("msg")
        return {"type": "message", "id": self._message_id, "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def _part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    # -- the stream -----------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def _open_message(self) -> list[dict[str, Any]]:
        if None in self._order:
            return []
        self._order.append(None)
        self._message_id = self._message_id or _new_id("msg")
        at = self._index(None)
        return [self._event("response.output_item.added", output_index=at, item=self._message("in_progress")),
                self._event("response.content_part.added", item_id=self._message_id, output_index=at,
                            content_index=0, part=self._part(""))]

    def text(self, delta: str, logprobs: tuple[TokenLogprob, ...] = ()) -> list[dict[str, Any]]:
        """Content text, with its tokens' logprobs (when asked for)."""
        entries = _logprobs(logprobs)
        self._content.append(delta)
        self._logprobs += entries
        out = self._open_message()
        out.append(self._event("response.output_text.delta", item_id=self._message_id, output_index=self._index(None),
                               content_index=0, delta=delta, logprobs=entries))
        return out

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        text, at = "".join(self._content), self._index(None)
        return [self._event("response.output_text.done", item_id=self._message_id, output_index=at,
                            content_index=0, text=text, logprobs=self._logprobs),
                self._event("response.content_part.done", item_id=self._message_id, output_index=at,
                            content_index=0, part=self._part(text, self._logprobs)),
                self._event("response.output_item.done", output_index=at, item=self._message(status))]

    def _index(self, key: int | None) -> int:
        """An item's place in a stream's ``output`` (``key``: None the message, else a call)."""
        return self._order.index(key)

    def call(self, d: CallDelta) -> list[dict[str, Any]]:
        out = []
        if d.index not in self._calls:
            self._calls[d.index] = self._item(d.id or _new_id("call"), d.name or "", "")
            self._order.append(d.index)
            out.append(self._event("response.output_item.added", output_index=self._index(d.index),
                                   item=dict(self._calls[d.index], status="in_progress")))
        item = self._calls[d.index]
        if d.arguments:
            item["arguments"] += d.arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self._index(d.index), delta=d.arguments))
        return out

    def set_calls(self, calls: list[ToolCall]) -> None:
        """The calls of the answer as read back whole: for a streamed answer, the
        arguments its ``.done`` events and the response carry (the deltas were the text
        as it came)."""
        streamed = {item["call_id"]: key for key, item in self._calls.items()}
        for c in calls:
            key = streamed.get(c.id)
            if key is not None:
                self._calls[key].update(name=c.name, arguments=c.arguments)
            else:
                self._calls[max(self._calls, default=-1) + 1] = self._item(c.id, c.name, c.arguments)

    def _item(self, call_id: str, name: str, arguments: str) -> dict[str, Any]:
        item = {"type": "function_call", "id": _new_id("fc"), "call_id": call_id, "name": name,
                "arguments": arguments}
        if name in self._namespaces:
            item["namespace"] = self._namespaces[name]
        return item

    def assistant_message(self) -> dict[str, Any]:
        """The answer as the chat message a later turn reads (its text and calls)."""
        calls = [{"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in self._calls.values()]
        return {"role": "assistant", "content": "".join(self._content) or None, **({"tool_calls": calls} if calls else {})}

    def set_text(self, text: str, logprobs: list[TokenLogprob] | None = None, at: int = 0) -> None:
        """The whole answer's text (``at``: how many of its calls came before it), after
        :meth:`set_calls`: the items stand in the order its stream would have added them
        (a message when there is text, or nothing else)."""
        self._content = [text]
        self._logprobs = _logprobs(logprobs or ())
        calls = list(self._calls)
        self._order = [*calls[:at], None, *calls[at:]] if text or not calls else calls

    def finish(self, usage: dict[str, Any], incomplete: str | None) -> list[dict[str, Any]]:
        """The items' ``.done`` events, in order (the message stays open until now: text
        may follow a call), then the response's."""
        # (an answer with neither text nor calls is an empty message; a call read back
        # whole that never streamed takes its place after the others)
        out = [] if self._calls or self._order else self._open_message()
        self._order += [i for i in self._calls if i not in self._order]
        for key in self._order:
            # (cut short: the item being written when the answer stopped)
            item_status = "incomplete" if incomplete and key == self._order[-1] else "completed"
            if key is None:
                out += self._close_message(item_status)
                continue
            item = self._calls[key]
            out += [self._event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=self._index(key), arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=self._index(key),
                                item=dict(item, status=item_status))]
        status = "incomplete" if incomplete else "completed"
        out.append(self._event(f"response.{status}", response=self.response(status, usage, incomplete)))
        return out


def _logprobs(entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Output tokens' logprobs: the Responses API's shape is chat's."""
    return ChatLogprobs.of(entries).model_dump(mode="json")["content"] if entries else []


def usage_object(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    """The Responses API's ``usage``."""
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


class ResponseObject(BaseModel):
    """The ``response`` object (the OpenAPI document's view of :meth:`ResponseEvents.response`)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
