"""Tool calls and structured output: what the model is shown, what it may write, and how
its output is read back. Pure logic (no engine, no I/O).

Theory of operation
-------------------
A chat request's ``tools`` become :class:`ToolSpec` s; its ``tool_choice`` and
``response_format`` become a :class:`Structure` (or None: free text), which says what
the output must be. ``Structure.grammar()`` is a Lark grammar (llguidance's dialect, JSON
schemas embedded with ``%json``) that :mod:`meshnode.serve.structured` compiles into
per-token masks, so sampling can only produce text the grammar accepts:

* ``tool_choice`` ``"required"``: one call of any tool (up to :data:`MAX_PARALLEL_CALLS`
  when ``parallel_tool_calls`` is not false), a named function: one call of that one;
* ``response_format`` ``json_object``: a JSON object; ``json_schema``: a value that
  matches the schema;
* ``tool_choice`` ``"auto"`` is not constrained (the model may answer in text); its
  calls are parsed when they are well-formed, otherwise the text stays content.

The call format is the one Hermes-style models (Qwen 2.5, SmolLM3, Hermes) are trained
on: each call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. A
model whose GGUF chat template renders ``tools`` gets them through its own template
(:func:`render_messages` with ``native=True``); for any other template the tools go into
a system message in that format (:data:`FALLBACK_TOOLS_PROMPT`), earlier calls are
written back as ``<tool_call>`` blocks and tool results as ``<tool_response>`` blocks
in a user turn.

:class:`ToolCallParser` reads the output back, fed text as it streams: text outside
the blocks is content, each block becomes a :class:`~meshnode.serve.client.ToolCall`.
While streaming, a block whose text starts ``{"name": "X", "arguments": `` (what the
grammar produces) is announced at once and its arguments stream as they come; any
other block is held until it closes.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from meshnode.serve.client import ChatMessage, ToolCall
from meshnode.serve.errors import InvalidRequestError

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8          # calls one constrained answer may hold
NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

FALLBACK_TOOLS_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI (and chat templates) spell it."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class Structure:
    """What the output must be. ``kind`` ``tool_calls``: 1..``max_calls`` calls of
    ``tools``; ``json``: one JSON value matching ``schema``."""

    kind: Literal["tool_calls", "json"]
    schema: dict[str, Any] | None = None
    tools: tuple[ToolSpec, ...] = ()
    max_calls: int = 1

    def grammar(self) -> str:
        """The Lark grammar (llguidance) of the allowed output."""
        if self.kind == "json":
            return f"start: %json {_dump(_compact(self.schema or {}))}\n"
        call = _compact({"anyOf": [_call_schema(t) for t in self.tools]} if len(self.tools) > 1
                        else _call_schema(self.tools[0]))
        more = f'("\\n" call){{0,{self.max_calls - 1}}}' if self.max_calls > 1 else ""
        return (f"start: call {more}\n"
                f'call: "{TOOL_OPEN}\\n" %json {_dump(call)} "\\n{TOOL_CLOSE}"\n')


# JSON written one way, on one line, with the spaces models are trained on: free
# whitespace would let a small model pad the output with newlines until max_tokens.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": _JSON_STYLE}


def _dump(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    # name first: the stream can announce the call before its arguments are written
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


# --- the request side ----------------------------------------------------------------


def tool_specs(tools: Sequence[Any]) -> tuple[ToolSpec, ...]:
    """ToolSpecs of a request's parsed ``tools`` (schemas.ToolDef); InvalidRequestError
    names the first bad field."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"At most {MAX_TOOLS} tools are supported ({len(tools)} given).")
    out: list[ToolSpec] = []
    seen: set[str] = set()
    for i, t in enumerate(tools):
        fn = t.function
        if not NAME_RE.fullmatch(fn.name):
            raise InvalidRequestError(f"tools[{i}].function.name", f"Invalid function name {fn.name[:80]!r}: "
                                      "use 1-64 letters, digits, '_', '.' or '-'.")
        if fn.name in seen:
            raise InvalidRequestError(f"tools[{i}].function.name", f"Duplicate function name {fn.name!r}.")
        seen.add(fn.name)
        params = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
        if params.get("type", "object") != "object":
            raise InvalidRequestError(f"tools[{i}].function.parameters",
                                      "Function parameters must be a JSON schema of type 'object'.")
        out.append(ToolSpec(fn.name, fn.description or "", params))
    return tuple(out)


def tool_structure(tools: tuple[ToolSpec, ...], choice: Any, parallel: bool | None) -> tuple[Structure | None, bool]:
    """(the constraint, whether the output is parsed for calls) for ``tool_choice``:
    ``"none"`` / ``"auto"`` / ``"required"`` or ``{"type": "function", "function":
    {"name": ...}}`` (already shape-checked by the schema)."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice", "tool_choice needs tools.")
        return None, False
    if choice is None or choice == "auto":
        return None, True
    if choice == "none":
        return None, False
    if choice == "required":
        return Structure("tool_calls", tools=tools, max_calls=1 if parallel is False else MAX_PARALLEL_CALLS), True
    name = choice.function.name
    named = [t for t in tools if t.name == name]
    if not named:
        raise InvalidRequestError("tool_choice.function.name", f"tool_choice names {name[:80]!r}, which is not in tools.")
    return Structure("tool_calls", tools=(named[0],), max_calls=1), True


def json_structure(response_format: Any) -> Structure | None:
    """The constraint of ``response_format`` (schemas.ResponseFormat) or None."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return Structure("json", schema={"type": "object"})
    spec = response_format.json_schema
    if spec is None:
        raise InvalidRequestError("response_format.json_schema", "response_format json_schema needs 'json_schema'.")
    schema = spec.schema_ if spec.schema_ is not None else {"type": "object"}
    return Structure("json", schema=schema)


# --- the prompt ----------------------------------------------------------------------


def render_messages(messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], *,
                    native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. ``native``: the template renders tools
    itself (calls are passed with their arguments as objects, as HF templates expect);
    otherwise the fallback format is written into the messages."""
    if native:
        out = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": _arguments_object(c.arguments)}} for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out, ([t.openai() for t in tools] or None)
    out = []
    for m in messages:
        if m.role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"})
        elif m.tool_calls:
            blocks = "\n".join(format_call(c.name, c.arguments) for c in m.tool_calls)
            out.append({"role": m.role, "content": f"{m.content}\n{blocks}" if m.content else blocks})
        else:
            out.append({"role": m.role, "content": m.content})
    if tools:
        prompt = FALLBACK_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.openai()) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def format_call(name: str, arguments: str) -> str:
    args = json.dumps(_arguments_object(arguments))
    return f'{TOOL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n{TOOL_CLOSE}'


# what json.loads raises on text that is not JSON, or nested deeper than it recurses (a
# model can write 100,000 "[" as well as anything)
_JSON_ERRORS = (ValueError, RecursionError)


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except _JSON_ERRORS:
        return arguments    # a client's malformed arguments: shown as they are


# --- reading the output back -----------------------------------------------------------


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.\-]{1,64})"\s*,\s*"arguments"\s*:\s*')
# A block whose head (above) has not matched within this many characters is not streamed
# but read whole when it closes: the match runs at every token, and a model led to write
# pages of spaces first would make each one scan them all.
HEAD_WINDOW = 1024


def _args_end(args: str) -> int:
    """Where the arguments of a streamed block end: before the wrapper's closing "}" and
    the spaces around it, when the block ends so. (A regex for it, ``\\s*\\}\\s*$``,
    backtracks over every run of spaces: minutes for a block of a few hundred KB.)"""
    t = args.rstrip()
    return len(t[:-1].rstrip()) if t.endswith("}") else len(args)


@dataclass(slots=True)
class CallDelta:
    """A piece of a streamed call: ``index`` always, ``id`` and ``name`` once (first),
    then ``arguments`` text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class _Block:
    """One ``<tool_call>`` block as it arrives. Its text is kept in pieces (joined when
    the block closes, or while it is short enough to look for its head), and ``unsent``
    holds the arguments not streamed yet: a token costs the same however long the block."""

    index: int = -1            # the call's index in the stream, once it sends a delta
    parts: list[str] = field(default_factory=list)
    size: int = 0              # characters so far
    id: str | None = None      # set once announced (streaming mode)
    args_at: int = -1          # where the arguments start (streaming mode)
    unsent: str = ""           # the arguments after what was streamed (once announced)
    args_sent: bool = False    # some of the arguments went out
    held: int = 0              # unsent[:held] is spaces and braces only (scanned already)

    def add(self, text: str) -> None:
        if text:
            self.parts.append(text)
            self.size += len(text)
            if self.args_at >= 0:
                self.unsent += text

    @property
    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""


class ToolCallParser:
    """Sans-IO reader of a tool-calling answer. :meth:`feed` text, get content text and
    :class:`CallDelta` s; :meth:`finish` at the end. ``calls`` holds the parsed calls."""

    def __init__(self, tool_names: Sequence[str]) -> None:
        self._names = set(tool_names)
        self._buf = ""                 # outside a block: text that may start TOOL_OPEN
        self._block: _Block | None = None
        self.calls: list[ToolCall] = []
        # Indices of streamed calls: one per block that sent a delta, in order. A block
        # announced as a call that then is not one (cut short, malformed) keeps its
        # index, so the next call does not reuse it and merge into it at the client.
        self._indices = 0
        # Whitespace next to a call is not content, except that text on both sides of
        # calls keeps the whitespace that stood before them. Content's trailing
        # whitespace waits in _ws until what follows shows whether a call does; after a
        # call, leading whitespace is dropped. So a streamed answer's content equals the
        # whole one's however it is cut into tokens.
        self._ws = ""
        self._after_call = False
        self._started = False          # content other than whitespace was given out
        # how many calls came before the content began (None: no content yet): where a
        # whole answer's message stands among its calls, as a stream would have added it
        self.content_at: int | None = None

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        content: list[str] = []
        deltas: list[CallDelta] = []
        self._buf += text
        while self._buf:
            if self._block is None:
                i = self._buf.find(TOOL_OPEN)
                if i < 0:
                    keep = _partial_suffix(self._buf, TOOL_OPEN)
                    self._content(self._buf[:len(self._buf) - keep], content)
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self._content(self._buf[:i], content)
                self._buf = self._buf[i + len(TOOL_OPEN):]
                self._block = _Block()
            else:
                j = self._buf.find(TOOL_CLOSE)
                if j < 0:
                    keep = _partial_suffix(self._buf, TOOL_CLOSE)
                    self._block.add(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    deltas += self._stream_block(self._block)
                    break
                self._block.add(self._buf[:j])
                self._buf = self._buf[j + len(TOOL_CLOSE):]
                block, self._block = self._block, None
                got, text_back = self._close_block(block)
                deltas += got
                self._read(text_back, content)
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        """The end of the output: held text, and an unclosed block as text (or, when
        it parses as a whole call, as that call: a model may stop before the tag)."""
        rest, self._buf = self._buf, ""
        content: list[str] = []
        deltas: list[CallDelta] = []
        if self._block is None:
            self._content(rest, content)
        else:
            block, self._block = self._block, None
            block.add(rest)
            deltas, text = self._close_block(block, closed=False)
            self._read(text, content)
        if not self._after_call:
            content.append(self._ws)     # the answer's own trailing whitespace
        self._ws = ""
        return "".join(content), deltas

    def _content(self, text: str, out: list[str]) -> None:
        """Content text, less the whitespace next to a call (see ``__init__``)."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            out.append(self._ws + body)
            self._ws = text[len(body):]
            self._started = True
            if self.content_at is None:
                self.content_at = len(self.calls)
        else:
            self._ws += text

    def _read(self, text_back: str, out: list[str]) -> None:
        """A block closed: a call (``text_back`` empty) or text given back as content."""
        if text_back:
            self._content(text_back, out)
        else:
            self._called()

    def _called(self) -> None:
        """A call was announced or read (a block that is not one comes back as text)."""
        self._after_call = True
        if not self._started:
            self._ws = ""

    def _stream_block(self, b: _Block) -> list[CallDelta]:
        if b.args_at < 0:
            m = _HEAD.match(b.text) if b.size <= HEAD_WINDOW else None
            if m is None or m.group(1) not in self._names:
                return []
            b.args_at, b.id = m.end(), new_call_id()
            b.index = self._next_index()
            b.unsent = b.text[b.args_at:]
            self._called()
            out = [CallDelta(b.index, id=b.id, name=m.group(1))]
        else:
            out = []
        if not b.args_sent:
            # the spaces before the arguments are not theirs (the head's pattern takes
            # them when they came with it): the same deltas however the text is cut
            b.unsent = b.unsent.lstrip()
        # hold back the trailing run of spaces and braces: it may hold the wrapper's
        # closing brace, however long the run. Only the text after the part of it scanned
        # already is read, so a model writing pages of spaces costs once per character.
        safe = b.held + _run_start(b.unsent, b.held)
        if safe > b.held:
            out.append(CallDelta(b.index, arguments=b.unsent[:safe]))
            b.unsent = b.unsent[safe:]
            b.args_sent = True
        b.held = len(b.unsent)
        return out

    def _close_block(self, b: _Block, closed: bool = True) -> tuple[list[CallDelta], str]:
        """The deltas that complete ``b``, and text to give back as content ('' when
        the block was a call; ``closed``: the model wrote its closing tag)."""
        call = _parse_call(b.text, self._names)
        if b.id is not None:
            # announced already: finish its arguments from the same text
            unsent = b.unsent if b.args_sent else b.unsent.lstrip()
            rest = unsent[:max(0, _args_end(unsent))]
            if call is not None:
                self.calls.append(ToolCall(b.id, call.name, call.arguments))
            # else: cut short (max_tokens) or malformed: not a call; its streamed
            # pieces are out already (as with OpenAI's finish_reason "length")
            return ([CallDelta(b.index, arguments=rest)] if rest else []), ""
        if call is None:
            return [], f"{TOOL_OPEN}{b.text}{TOOL_CLOSE if closed else ''}"
        call = ToolCall(new_call_id(), call.name, call.arguments)
        self.calls.append(call)
        b.index = self._next_index()
        return [CallDelta(b.index, id=call.id, name=call.name), CallDelta(b.index, arguments=call.arguments)], ""

    def _next_index(self) -> int:
        self._indices += 1
        return self._indices - 1


def _parse_call(text: str, names: set[str]) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except _JSON_ERRORS:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except _JSON_ERRORS:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall("", obj["name"], json.dumps(args, ensure_ascii=False))


def _run_start(text: str, start: int) -> int:
    """Where, counted from ``start``, the trailing run of whitespace and "}" of
    ``text[start:]`` begins (0: all of it is such a run)."""
    i = len(text)
    while i > start and (text[i - 1] == "}" or text[i - 1].isspace()):
        i -= 1
    return i - start


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


class ReadAnswer(NamedTuple):
    """A whole answer read for tool calls."""

    content: str
    calls: list[ToolCall]
    content_at: int        # how many calls stand before the content (0 when there is none)


def split_tool_calls(text: str, tool_names: Sequence[str]) -> ReadAnswer:
    """A whole answer read back: its content, its calls and where the content stands."""
    p = ToolCallParser(tool_names)
    content, _ = p.feed(text)
    tail, _ = p.finish()
    return ReadAnswer(content + tail, p.calls, p.content_at or 0)
