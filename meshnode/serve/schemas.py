"""Pydantic models of the OpenAI wire format, and their conversion to engine requests.

Theory of operation: a route parses the raw body with :func:`parse_request`, which turns
malformed JSON and validation failures into :class:`~meshnode.serve.errors.
InvalidRequestError` (param = the offending field, e.g. ``messages[0].content``). The
request model then converts itself with ``to_generation_request(request_id)``, raising
:class:`~meshnode.serve.errors.UnsupportedValueError` for valid OpenAI features this
server does not implement (images, ``best_of`` other than ``n``).

Unknown fields are accepted (editors send vendor extras such as ``min_p``,
``cache_prompt``) and logged at debug level: they are
ignored, never an error. Response models mirror OpenAI's objects field for field, plus
the non-standard ``timings`` (llama.cpp server's) when the engine reports it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from meshnode.limits import MAX_BIAS, MAX_CHOICES, MAX_LOGIT_BIAS, MAX_REPEAT_PENALTY, MAX_TOP_LOGPROBS
from meshnode.serve.client import ChatMessage, GenerationRequest, InfillPrompt, TimingsJSON, TokenLogprob, ToolCall
from meshnode.serve.errors import InvalidRequestError, MalformedRequestError, UnsupportedValueError
from meshnode.serve.tools import MAX_TOOLS, json_structure, tool_specs, tool_structure

log = logging.getLogger("meshnode.serve.openai")

__all__ = [
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "CompletionChunk",
    "CompletionRequest",
    "CompletionResponse",
    "ErrorObject",
    "ErrorResponse",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "InfillRequest",
    "NativeCompletionRequest",
    "TokenizeRequest",
    "TokenizeResponse",
    "ModelList",
    "ModelObject",
    "UsageInfo",
    "parse_request",
]

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}

# Bounds on what one request may make the node hold or do. Validation runs on the event
# loop that also carries the mesh's heartbeats, and its cost grows with the number of
# objects: 130k empty messages in a 4 MiB body took 0.38 s to validate, 10k take 0.03 s.
MAX_MESSAGES = 10_000
MAX_CONTENT_PARTS = 1_000
# Stop strings are matched on every generated token, on the loop (StopMatcher): OpenAI
# allows 4; llama.cpp clients send a handful.
MAX_STOPS = 16
MAX_STOP_CHARS = 256
# The wire carries top_k as i32 and the seed as u64 (wire/messages.py Segment).
MAX_TOP_K = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
_StopStr = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


def _omit_none(v: Any) -> bool:
    return v is None


class _Lenient(BaseModel):
    """Accepts and keeps unknown fields (``model_extra``); subclasses log them."""

    model_config = ConfigDict(extra="allow")


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class FunctionCallIn(_Lenient):
    name: str = Field(max_length=256)
    arguments: str = ""


class ToolCallIn(_Lenient):
    """A call in an assistant message fed back (OpenAI's shape)."""

    id: str = Field(default="", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Lenient):
    role: str
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)
    # the legacy spelling (before tools): an assistant's call, and the function a role
    # "function" message answers
    function_call: FunctionCallIn | None = None
    name: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _known_role(self) -> ChatMessageIn:
        if self.role not in _ROLES:
            raise ValueError(f"unknown role {self.role!r}; expected one of {sorted(_ROLES)}")
        return self


class StreamOptions(_Lenient):
    include_usage: bool = False


# A completion prompt of token ids: a context's worth at most (llama.cpp's is < 2^20); and
# how many prompts a list may hold before the request is refused as a batch.
MAX_PROMPT_IDS = 1 << 20
MAX_PROMPTS = 1024

_Bias = Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS, allow_inf_nan=False)]


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs; raises InvalidRequestError for a key that
    is no token id (whether the id is in the model's vocabulary is checked with the model)."""
    pairs = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise InvalidRequestError("logit_bias", f"Invalid key in 'logit_bias': {key[:32]!r} "
                                                    "(expected a token id).")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


class _Penalties(_Lenient):
    """The penalties OpenAI's bodies and llama.cpp server's share."""

    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # llama.cpp's (over the context's last repeat_last_n tokens)
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=MAX_REPEAT_PENALTY)
    repeat_last_n: int | None = Field(default=None, ge=-1)

    def _penalties(self, repetition_penalty: float | None = None) -> dict[str, Any]:
        """GenerationRequest's penalty fields (with vLLM's ``repetition_penalty``)."""
        return {"presence_penalty": self.presence_penalty or 0.0, "frequency_penalty": self.frequency_penalty or 0.0,
                **_repetition(repetition_penalty, self.repeat_penalty, self.repeat_last_n)}


class _SamplingRequest(_Penalties):
    """Fields shared by chat and text completions."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    # llama.cpp extension; 0 and -1 (vLLM's spelling) turn it off
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K)
    # llama.cpp and vLLM extension: 0 (the default here, as OpenAI has none) turns it off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    # -1 is llama.cpp's and many clients' "random"; any other int64/uint64 is a seed
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: _StopStr | Annotated[list[_StopStr], Field(max_length=MAX_STOPS)] | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # token id (a decimal string, JSON keys being strings) -> bias added to its logit
    logit_bias: Annotated[dict[str, _Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # vLLM's (over the whole context)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=MAX_REPEAT_PENALTY)
    user: str | None = None

    @model_validator(mode="after")
    def _log_extras(self) -> _SamplingRequest:
        if self.model_extra:
            log.debug("%s: ignoring unknown fields %s", type(self).__name__, sorted(self.model_extra))
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _common_checks(self) -> None:
        _stop_strings(self.stop)

    def _generation_request(self, request_id: str, max_tokens: int | None, **prompt: Any) -> GenerationRequest:
        return GenerationRequest(
            request_id=request_id,
            model=self.model,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k if self.top_k and self.top_k > 0 else None,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=_stop_strings(self.stop),
            n=self.n or 1,
            logit_bias=_logit_bias(self.logit_bias),
            **self._penalties(self.repetition_penalty),
            **prompt,
        )


class FunctionDef(_Lenient):
    name: str = Field(max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None    # a JSON schema of type object
    strict: bool | None = None


class ToolDef(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str = Field(max_length=256)


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(_Lenient):
    mode: Literal["auto", "required"]
    tools: Annotated[list[NamedToolChoice], Field(min_length=1, max_length=MAX_TOOLS)]


class AllowedToolsChoice(_Lenient):
    """OpenAI's ``allowed_tools`` choice: every tool is in the prompt (so it stays the same
    from turn to turn), but only these may be called."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class JsonSchemaFormat(_Lenient):
    name: str | None = Field(default=None, max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Prediction(_Lenient):
    """OpenAI's predicted output: text the answer is expected to largely repeat (a file an
    edit leaves mostly as it is). It only supplies drafts (meshnode.serve.speculation):
    the answer is what the model says, with or without it."""

    type: Literal["content"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)]


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # tools and structured output (meshnode.serve.tools)
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    prediction: Prediction | None = None
    # OpenAI's deprecated spelling of tools, still sent by older clients: one call at most,
    # answered as the message's function_call with finish_reason "function_call"
    functions: Annotated[list[FunctionDef], Field(max_length=MAX_TOOLS)] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None

    @property
    def legacy_functions(self) -> bool:
        """Whether the tools come as ``functions`` (and calls go back as ``function_call``)."""
        return bool(self.functions) and not self.tools

    def _tools(self) -> tuple[list[ToolDef], list[str], Any, bool | None]:
        """(the tools of the prompt, the names of those that may be called, the choice
        among them, parallel_tool_calls): ``functions`` in the legacy spelling; an
        ``allowed_tools`` choice narrows what may be called and is its mode."""
        tools, choice, parallel = self.tools or [], self.tool_choice, self.parallel_tool_calls
        if self.legacy_functions:
            tools, parallel = [ToolDef(type="function", function=f) for f in self.functions or ()], False
            if isinstance(choice := self.function_call, NamedFunction):
                if choice.name not in {t.function.name for t in tools}:
                    raise InvalidRequestError("function_call.name",
                                              f"function_call names {choice.name[:80]!r}, which is not in functions.")
                choice = NamedToolChoice(type="function", function=choice)
        names = [t.function.name for t in tools]
        if isinstance(choice, AllowedToolsChoice):
            allowed = [t.function.name for t in choice.allowed_tools.tools]
            for i, name in enumerate(allowed):
                if name not in names:
                    raise InvalidRequestError(f"tool_choice.allowed_tools.tools[{i}].function.name",
                                              f"tool_choice allows {name[:80]!r}, which is not in tools.")
            names, choice = allowed, choice.allowed_tools.mode
        return tools, names, choice, parallel

    def tool_names(self) -> list[str] | None:
        """The tools whose calls the answer is read back for (None: plain content)."""
        _, names, choice, _ = self._tools()
        if not names or choice == "none":
            return None
        return names

    def _messages(self) -> tuple[ChatMessage, ...]:
        """The conversation, a legacy function call as a tool call and a role "function"
        message as the tool result that answers the latest call of its function."""
        out, call_ids = [], {}
        for i, m in enumerate(self.messages):
            msg = _flatten_message(i, m)
            if m.function_call is not None and not m.tool_calls:
                call = ToolCall(f"call_{i}", m.function_call.name, m.function_call.arguments)
                call_ids[call.name] = call.id
                msg = replace(msg, tool_calls=(call,))
            elif m.role == "function":
                msg = replace(msg, role="tool", tool_call_id=msg.tool_call_id or call_ids.get(m.name or "", f"call_{i}"))
            out.append(msg)
        return tuple(out)

    def to_generation_request(self, request_id: str) -> GenerationRequest:
        """The engine request; raises UnsupportedValueError / InvalidRequestError."""
        self._common_checks()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "top_logprobs needs 'logprobs': true.")
        messages = self._messages()
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        tool_defs, names, choice, parallel = self._tools()
        tools = tool_specs(tool_defs)
        callable_names = set(names)
        structure, _ = tool_structure(tuple(t for t in tools if t.name in callable_names), choice, parallel)
        if structure is None:
            structure = json_structure(self.response_format)
        prediction = None
        if self.prediction is not None:
            prediction = _flatten_message(0, ChatMessageIn(role="assistant", content=self.prediction.content),
                                          param="prediction.content").content
        return self._generation_request(request_id, max_tokens, messages=messages, tools=tools,
                                        structure=structure, prediction=prediction or None,
                                        logprobs=(self.top_logprobs or 0) if self.logprobs else None)


class CompletionRequest(_SamplingRequest):
    # (bounded in the parsing thread, so turning ids into a request on the loop stays short)
    prompt: (str | Annotated[list[str], Field(max_length=MAX_PROMPTS)] | Annotated[list[int], Field(max_length=MAX_PROMPT_IDS)]
             | Annotated[list[Annotated[list[int], Field(max_length=MAX_PROMPT_IDS)]], Field(max_length=MAX_PROMPTS)])

    @field_validator("prompt", mode="before")
    @classmethod
    def _bounded(cls, v: Any) -> Any:
        # said here: past the bounds above, the union's error would name its first branch
        if isinstance(v, list) and (len(v) > MAX_PROMPT_IDS or v and isinstance(v[0], list)
                                    and len(v[0]) > MAX_PROMPT_IDS):
            raise ValueError(f"at most {MAX_PROMPT_IDS} token ids")
        if isinstance(v, list) and v and isinstance(v[0], (str, list)) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts")
        return v
    suffix: str | None = None
    # the prompt comes back first (with logprobs: scored); max_tokens 0 then only scores it
    echo: bool | None = False
    max_tokens: int | None = Field(default=None, ge=0)
    best_of: int | None = None
    # the sampled tokens' logprobs and this many alternatives each (OpenAI allows 5)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def to_generation_requests(self, request_id: str) -> list[GenerationRequest]:
        """One engine request per prompt (a batch: ids ``request_id-i``); raises
        UnsupportedValueError / InvalidRequestError."""
        self._common_checks()
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens", "max_tokens 0 generates nothing; it needs 'echo': true.")
        if self.echo and self.suffix:
            raise UnsupportedValueError("echo", "echo and suffix cannot be used together.")
        if self.best_of not in (None, 1, self.n):
            raise UnsupportedValueError("best_of", "best_of other than n is not supported.")
        prompt = self.prompt
        # one prompt: text, or token ids; a batch: a list of either
        prompts = [prompt] if isinstance(prompt, str) or prompt and isinstance(prompt[0], int) else list(prompt)
        if not prompts:
            raise InvalidRequestError("prompt", "'prompt' is an empty list.")
        if self.suffix and (len(prompts) > 1 or not isinstance(prompts[0], str)):
            raise UnsupportedValueError("suffix", "suffix needs a single text prompt.")
        if len(prompts) == 1:
            return [self._one(request_id, prompts[0], "prompt")]
        return [self._one(f"{request_id}-{i}", p, f"prompt[{i}]") for i, p in enumerate(prompts)]

    def to_generation_request(self, request_id: str) -> GenerationRequest:
        """The engine request of a request with one prompt (raises UnsupportedValueError
        for a batch)."""
        reqs = self.to_generation_requests(request_id)
        if len(reqs) != 1:
            raise UnsupportedValueError("prompt", "A batch of prompts needs to_generation_requests.")
        return reqs[0]

    def _one(self, request_id: str, prompt: str | list[int], param: str) -> GenerationRequest:
        if self.suffix:   # fill in the middle: the prompt (text) is what comes before the cursor
            return self._generation_request(request_id, self.max_tokens, logprobs=self.logprobs,
                                            infill=InfillPrompt(prefix=str(prompt), suffix=self.suffix))
        return self._generation_request(request_id, self.max_tokens, logprobs=self.logprobs, echo=bool(self.echo),
                                        **_prompt_fields(prompt, param))


MAX_EXTRA_CHUNKS = 1_000


class InfillChunk(_Lenient):
    filename: str | None = None
    text: str = ""


class _LlamaCppRequest(_Penalties):
    """The fields of llama.cpp server's own bodies (``/completion``, ``/infill``), with its
    defaults. ``model`` is optional (llama.cpp serves one model): without it, the node's
    first model. ``n_predict`` -1 (or absent) generates until the context is full."""

    model: str | None = Field(default=None, min_length=1)
    n_predict: int | None = Field(default=None, ge=-1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: _StopStr | Annotated[list[_StopStr], Field(max_length=MAX_STOPS)] | None = None
    stream: bool | None = False
    # each generated token's probability and this many alternatives (0: none)
    n_probs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def _generation_request(self, request_id: str, model: str, **prompt: Any) -> GenerationRequest:
        stops = _stop_strings(self.stop)
        max_tokens = self.max_tokens
        if max_tokens is None and self.n_predict is not None and self.n_predict > 0:
            max_tokens = self.n_predict
        return GenerationRequest(
            request_id=request_id, model=self.model or model, max_tokens=max_tokens,
            # llama.cpp's defaults: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05
            temperature=0.8 if self.temperature is None else self.temperature,
            top_p=0.95 if self.top_p is None else self.top_p,
            top_k=40 if self.top_k is None else (self.top_k if self.top_k > 0 else None),
            min_p=0.05 if self.min_p is None else self.min_p,
            **self._penalties(), logprobs=self.n_probs or None, seed=self.seed, stop=stops, **prompt)


class InfillRequest(_LlamaCppRequest):
    """llama.cpp server's ``/infill`` body (what llama.vim and llama.vscode send)."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: Annotated[list[InfillChunk], Field(max_length=MAX_EXTRA_CHUNKS)] = []
    prompt: str = ""

    def to_generation_request(self, request_id: str, model: str) -> GenerationRequest:
        return self._generation_request(request_id, model, infill=InfillPrompt(
            prefix=self.input_prefix, suffix=self.input_suffix, prompt=self.prompt,
            extra=tuple((c.filename or "", c.text) for c in self.input_extra)))


class NativeCompletionRequest(_LlamaCppRequest):
    """llama.cpp server's ``/completion`` body (what Continue's ``llama.cpp`` provider and
    scripts written for llama.cpp's server send): a text prompt (a BOS first where the
    model adds one, as llama.cpp does) or token ids (as given)."""

    prompt: str | Annotated[list[int], Field(max_length=MAX_PROMPT_IDS)]

    def to_generation_request(self, request_id: str, model: str) -> GenerationRequest:
        return self._generation_request(request_id, model, **_prompt_fields(self.prompt, "prompt"))


# llama.cpp's repeat_last_n when a body gives repeat_penalty without it
LLAMACPP_REPEAT_LAST_N = 64


def _repetition(vllm: float | None, llamacpp: float | None, last_n: int | None) -> dict[str, Any]:
    """GenerationRequest's repetition fields: vLLM's ``repetition_penalty`` over the whole
    context, or llama.cpp's ``repeat_penalty`` over its last ``repeat_last_n`` tokens (64
    by default; -1: all of it; 0: off)."""
    if vllm is not None and llamacpp is not None:
        raise InvalidRequestError("repeat_penalty", "Give 'repetition_penalty' (vLLM's) or 'repeat_penalty' "
                                                    "(llama.cpp's), not both.")
    if vllm is not None:
        return {"repetition_penalty": vllm, "repeat_last_n": -1 if last_n is None else last_n}
    if llamacpp is not None:
        return {"repetition_penalty": llamacpp, "repeat_last_n": LLAMACPP_REPEAT_LAST_N if last_n is None else last_n}
    return {}


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """A request's ``stop`` as a tuple; raises InvalidRequestError for an empty string."""
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not s for s in stops):
        raise InvalidRequestError("stop", "Stop strings must be non-empty.")
    return stops


def _prompt_fields(prompt: str | list[int], param: str) -> dict[str, Any]:
    """A completion prompt as GenerationRequest fields: text, or token ids as given (no
    BOS added; checked against the vocabulary with the model)."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if not prompt:
        raise InvalidRequestError(param, f"'{param}' is an empty list of token ids.")
    return {"prompt_ids": tuple(prompt)}


class TokenizeRequest(_Lenient):
    """``POST /tokenize``: vLLM's body (``prompt``, ``add_special_tokens``, default true;
    or ``messages`` with ``tools`` and ``add_generation_prompt``, default true, laid out
    by the chat template as a chat completion's prompt is) or llama.cpp server's
    (``content``, ``add_special``, default false); ``model`` optional (the node's model)."""

    model: str | None = Field(default=None, min_length=1)
    prompt: str | None = None
    content: str | None = None
    add_special_tokens: bool | None = None
    add_special: bool | None = None
    messages: Annotated[list[ChatMessageIn], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    add_generation_prompt: bool = True

    def chat_request(self) -> GenerationRequest | None:
        """With ``messages``, the chat request whose prompt is tokenized (None: a text)."""
        if self.messages is None:
            if self.tools is not None:
                raise InvalidRequestError("tools", "'tools' are tokenized with 'messages'.")
            return None
        if self.prompt is not None or self.content is not None:
            raise InvalidRequestError("messages", "Give 'messages' or a text ('prompt' or 'content'), not both.")
        return GenerationRequest("tokenize", self.model or "", tools=tool_specs(self.tools or []),
                                 messages=tuple(_flatten_message(i, m) for i, m in enumerate(self.messages)))

    def text_and_bos(self) -> tuple[str, bool]:
        """The text, and whether a BOS token goes first (when the model adds one)."""
        if (self.prompt is None) == (self.content is None):
            raise InvalidRequestError("prompt", "Give the text to tokenize as 'prompt' (or 'content'), once, "
                                                "or a conversation as 'messages'.")
        if self.prompt is not None:
            return self.prompt, self.add_special_tokens is not False
        return self.content or "", bool(self.add_special)


class DetokenizeRequest(_Lenient):
    """``POST /detokenize`` (vLLM's and llama.cpp server's body)."""

    model: str | None = Field(default=None, min_length=1)
    tokens: Annotated[list[int], Field(max_length=MAX_PROMPT_IDS)]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str     # vLLM's name
    content: str    # llama.cpp server's


def _flatten_message(index: int, m: ChatMessageIn, param: str | None = None) -> ChatMessage:
    """String content stays; a list of text parts is joined with newlines (as vLLM does)."""
    role = "system" if m.role == "developer" else m.role
    extra: dict[str, Any] = {}
    if m.tool_calls:
        extra["tool_calls"] = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls)
    if m.tool_call_id is not None:
        extra["tool_call_id"] = m.tool_call_id
    if m.content is None:
        return ChatMessage(role, "", **extra)
    if isinstance(m.content, str):
        return ChatMessage(role, m.content, **extra)
    texts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            raise UnsupportedValueError(
                f"{param or f'messages[{index}].content'}[{j}].type",
                f"Content part type {part.type!r} is not supported; only text parts are.",
            )
        texts.append(part.text)
    return ChatMessage(role, "\n".join(texts), **extra)


# --- parsing raw bodies ----------------------------------------------------------------

_M = TypeVar("_M", bound=BaseModel)


def parse_request(model: type[_M], body: bytes) -> _M:
    """Parse a raw JSON body into ``model``.

    Raises MalformedRequestError (not JSON / not an object) or InvalidRequestError with
    ``param`` set to the first offending field. Hostile JSON is the caller's mistake too:
    NaN/Infinity (not JSON), nesting deeper than the parser's recursion limit, integers
    past Python's 4300-digit conversion limit (all ValueError or RecursionError).
    """
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:   # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise MalformedRequestError(
            f"We could not parse the JSON body of your request ({reason}). The body must be a JSON object."
        ) from None
    if not isinstance(data, dict):
        raise MalformedRequestError("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _param_path(err["loc"])
        if err["type"] == "missing":
            raise InvalidRequestError(param, f"Missing required parameter: '{param}'.") from None
        raise InvalidRequestError(param, f"Invalid value for '{param}': {err['msg']}.") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# Tags pydantic puts in ``loc`` for union members: builtin type names, class names
# ('ContentPart') and composite forms ('list[ContentPart]', 'function-after[...]').
# Our wire fields are all lower snake_case, so anything else is a tag.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _param_path(loc: tuple[int | str, ...]) -> str | None:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part.islower() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or None


# --- responses -------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0   # prompt tokens whose KV was reused (prefix reuse), not computed


class CompletionTokensDetails(BaseModel):
    # OpenAI's predicted output: the prediction's tokens the completion repeats, and the rest
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    # only for a request with a ``prediction`` (the response leaves it out otherwise)
    completion_tokens_details: CompletionTokensDetails | None = Field(default=None, exclude_if=_omit_none)


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = Field(default=None, exclude_if=_omit_none)
    function_call: FunctionCallOut | None = Field(default=None, exclude_if=_omit_none)   # legacy functions


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(BaseModel):
    """A chat choice's ``logprobs``: one entry per generated token of its content."""

    content: list[TokenLogprobOut] | None

    @classmethod
    def of(cls, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
        return cls(content=[TokenLogprobOut(
            token=e.token, logprob=e.logprob, bytes=list(e.bytes),
            top_logprobs=[TopLogprobOut(token=t.token, logprob=t.logprob, bytes=list(t.bytes)) for t in e.top])
            for e in entries])


class CompletionLogprobs(BaseModel):
    """A text completion choice's ``logprobs`` (the legacy shape); ``text_offset`` counts
    characters from the start of the choice's text."""

    tokens: list[str]
    # None for an echoed prompt's first token (nothing precedes it)
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    @classmethod
    def of(cls, entries: Sequence[TokenLogprob], offset: int = 0) -> CompletionLogprobs:
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e.token)
        return cls(tokens=[e.token for e in entries], token_logprobs=[e.logprob for e in entries],
                   top_logprobs=[None if e.logprob is None else {t.token: t.logprob for t in e.top}
                                 for e in entries], text_offset=offsets)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    timings: TimingsJSON | None = Field(default=None, exclude_if=_omit_none)


class FunctionCallDelta(BaseModel):
    name: str | None = Field(default=None, exclude_if=_omit_none)
    arguments: str = ""


class ToolCallDelta(BaseModel):
    """A streamed piece of a call: id, type and name in its first chunk, then arguments."""

    index: int
    id: str | None = Field(default=None, exclude_if=_omit_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_omit_none)
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: str | None = Field(default=None, exclude_if=_omit_none)
    content: str | None = Field(default=None, exclude_if=_omit_none)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_omit_none)
    function_call: FunctionCallDelta | None = Field(default=None, exclude_if=_omit_none)   # legacy functions


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_omit_none)
    timings: TimingsJSON | None = Field(default=None, exclude_if=_omit_none)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    timings: TimingsJSON | None = Field(default=None, exclude_if=_omit_none)


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_omit_none)
    timings: TimingsJSON | None = Field(default=None, exclude_if=_omit_none)


class ModelObject(BaseModel):
    """OpenAI's model object, plus what editors otherwise guess: the context length,
    which features the model supports (``capabilities``) and why not where it does not
    (``unsupported``)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    meta: dict[str, Any] | None = Field(default=None, exclude_if=_omit_none)  # e.g. {"n_ctx": 8192}
    # where it is served: {"coordinator": {"id", "name"}, "context_length", "local"}
    meshnode: dict[str, Any] | None = Field(default=None, exclude_if=_omit_none)
    context_length: int | None = Field(default=None, exclude_if=_omit_none)
    capabilities: dict[str, bool] | None = Field(default=None, exclude_if=_omit_none)
    unsupported: dict[str, str] | None = Field(default=None, exclude_if=_omit_none)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class InfillResponse(BaseModel):
    """llama.cpp server's ``/infill`` answer (also each streamed chunk, ``stop`` false
    until the last)."""

    index: int = 0
    content: str
    stop: bool
    model: str
    tokens_predicted: int | None = Field(default=None, exclude_if=_omit_none)
    tokens_evaluated: int | None = Field(default=None, exclude_if=_omit_none)
    stop_type: str | None = Field(default=None, exclude_if=_omit_none)
    timings: TimingsJSON | None = Field(default=None, exclude_if=_omit_none)
    # with n_probs: each token's {id, token, bytes, logprob, top_logprobs} (llama.cpp's)
    completion_probabilities: list[dict[str, Any]] | None = Field(default=None, exclude_if=_omit_none)


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the endpoint answers (``errors.error_body``): OpenAI's error object."""

    error: ErrorObject
