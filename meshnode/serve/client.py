"""The seam between the OpenAI layer and whatever generates text (vLLM's EngineClient).

Theory of operation: the HTTP layer parses a request into a frozen
:class:`GenerationRequest` and calls :meth:`EngineClient.generate`, which returns an
async iterator of :data:`GenerationEvent` s:

    [Admitted]  TextDelta*  Finished

(for ``n`` > 1 choices: the choices' TextDelta and Finished events interleaved, each
tagged with its ``index``; the stream ends after ``n`` Finished events)

Contract for implementations (the real pipeline driver and test fakes alike):

* ``generate`` is an async generator function (``async def ... yield``). Problems with the
  request itself (``UnknownModelError``, ``PromptTooLongError``, ``InvalidRequestError``)
  and ``EngineUnavailableError`` must be raised *before* the first event: the layer pulls
  the first event before it commits to an HTTP 200, so these become proper 4xx/503
  responses even for ``stream=true``. Yielding :class:`Admitted` right after tokenizing
  and admission (before prefill) lets a streaming response start early; it is optional.
* Errors after the first event become in-band SSE errors (or, for non-streaming, the
  status of their row in :data:`~meshnode.serve.errors.ERROR_TABLE`: engine and mesh
  failures such as a context overflow or a lost peer may be raised as they are).
* The engine client owns tokenization, the chat template *and stop strings*: it knows
  tokens, can stop decoding the moment a stop string completes and free the session,
  and reports usage/timings that match what it actually computed. Text in
  :class:`TextDelta` never contains a stop string or anything after it; a stop-string hit
  ends with ``Finished(finish_reason="stop")``. :class:`StopMatcher` does the text side.
* Cancellation: when the HTTP client goes away the layer cancels the task awaiting the
  generator and/or calls ``aclose()`` on it. Either arrives at the generator's current
  ``await``/``yield`` as ``CancelledError``/``GeneratorExit``; the engine frees the
  session in a ``finally`` block.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

__all__ = [
    "Admitted",
    "ChatMessage",
    "EngineClient",
    "Finished",
    "FinishReason",
    "GenerationEvent",
    "GenerationRequest",
    "InfillPrompt",
    "ModelCard",
    "StopMatcher",
    "TextDelta",
    "Timings",
    "ToolCall",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
]

FinishReason: TypeAlias = Literal["stop", "length", "tool_calls"]


@dataclass(frozen=True, slots=True)
class ModelCard:
    """One servable model, as listed by ``GET /v1/models``."""

    id: str
    created: int = 0                # unix seconds; 0 when unknown
    owned_by: str = "meshnode"
    n_ctx: int | None = None        # context window, when known (non-standard, informative)
    # where it is served (the mesh-wide endpoint; "" when the client does not say)
    coordinator_id: str = ""
    coordinator_name: str = ""
    local: bool = True              # coordinated by this node
    # what the model supports, by name (``fim``, ``logprobs``, ``n``, ...), and for the
    # ones it does not, why (e.g. {"fim": "the GGUF declares no FIM tokens"})
    capabilities: tuple[str, ...] = ()
    unsupported: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call: in an assistant message fed back, or parsed from the output."""

    id: str
    name: str
    arguments: str                  # a JSON object, as text (OpenAI's shape)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str                       # system | user | assistant | tool
    content: str
    tool_calls: tuple[ToolCall, ...] = ()   # an assistant's earlier calls
    tool_call_id: str | None = None         # a tool result: the call it answers


@dataclass(frozen=True, slots=True)
class InfillPrompt:
    """A fill-in-the-middle prompt (llama.cpp server's ``/infill`` fields): the model
    writes what goes between ``prefix`` and ``suffix``; ``prompt`` is text already typed
    after the prefix; ``extra`` are ``(filename, text)`` chunks of other files."""

    prefix: str
    suffix: str
    prompt: str = ""
    extra: tuple[tuple[str, str], ...] = ()

    @property
    def n_chars(self) -> int:
        return len(self.prefix) + len(self.suffix) + len(self.prompt) + sum(len(f) + len(t) for f, t in self.extra)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What to generate. Exactly one of ``messages`` (chat), ``prompt`` (raw text),
    ``prompt_ids`` (token ids, as given) and ``infill`` (fill-in-the-middle) is set.

    ``max_tokens`` None means "until the context is full". ``top_k`` None or 0 disables
    top-k. ``stop`` strings are matched on the generated text (not on the prompt).
    ``logprobs``: None for none, else how many alternatives per token (0..20) besides the
    sampled token's own logprob. ``n``: choices generated from the one prompt.
    """

    request_id: str
    model: str
    messages: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0          # llama.cpp's min_p (0: off)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Tools and structured output (meshnode.serve.tools): the tool definitions shown to
    # the model, and what its output must be (None: free text).
    tools: tuple[Any, ...] = ()             # tools.ToolSpec
    structure: Any = None                   # tools.Structure
    logprobs: int | None = None
    n: int = 1
    infill: InfillPrompt | None = None
    prompt_ids: tuple[int, ...] | None = None
    # OpenAI's logit_bias as (token id, bias) pairs, checked against the vocabulary by
    # meshnode.serve.model_server.sampling_for
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's penalties, -2..2, on the tokens the answer already holds
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's repetition_penalty / llama.cpp's repeat_penalty (1: off) over the context's
    # last repeat_last_n tokens (-1: all of it, prompt included, as vLLM; llama.cpp: 64)
    repetition_penalty: float = 1.0
    repeat_last_n: int = -1
    # Who asked (the peer address, plus a hash of the API key it sent): speculation drafts
    # from the same client's recent requests (meshnode.spec.suffix). Empty: nobody's.
    client: str = ""
    # the answer as the client expects it (OpenAI's predicted output): drafts only
    prediction: str | None = None
    # OpenAI's echo (completions): each choice's text starts with the prompt, and with
    # ``logprobs`` each prompt token's logprob comes first
    echo: bool = False

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.messages, self.prompt, self.prompt_ids, self.infill)) != 1:
            raise ValueError("GenerationRequest needs exactly one of messages, prompt, prompt_ids and infill")


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # with a predicted output (OpenAI's ``prediction``): how many of its tokens the
    # completion repeats, and how many it does not (meshnode.serve.request.prediction_usage); None without one
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


TimingsJSON = dict[str, float | int | str]   # Timings.to_json(): the responses' ``timings``


@dataclass(frozen=True, slots=True)
class Timings:
    """Per-request timings in llama.cpp server's vocabulary (its ``timings`` object).

    ``prompt_n`` counts the prompt tokens computed, ``cache_n`` those whose KV was reused
    from an earlier request (prefix reuse; llama.cpp's meaning of both). ``draft_n`` counts drafted tokens sent for verification, ``draft_n_accepted`` those
    accepted (acceptance rate = accepted / drafted), both 0 without speculation. The
    rest is ours (llama.cpp has no such fields): ``draft_windows`` verify steps taking
    ``draft_verify_ms`` in all, ``plain_steps`` one-token steps, lookahead windows sent
    and used (:mod:`meshnode.spec.lookahead`), the windows a draft model drafted (of
    ``draft_windows``; the rest came from the n-gram proposer) with their drafts and
    accepted drafts, and the strategy, its auto-policy state and window size when the
    request ended.
    """

    prompt_n: int = 0
    prompt_ms: float = 0.0
    cache_n: int = 0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0
    draft_n_accepted: int = 0
    draft_windows: int = 0
    draft_verify_ms: float = 0.0
    plain_steps: int = 0
    draft_lookahead: int = 0
    draft_lookahead_used: int = 0
    draft_model_windows: int = 0
    draft_model_n: int = 0
    draft_model_n_accepted: int = 0
    spec_strategy: str = ""
    spec_state: str = ""
    spec_window: int = 0

    def to_json(self) -> TimingsJSON:
        """The llama.cpp-shaped dict, with the derived per-token and per-second rates,
        then the speculation fields (``spec_*`` only when a strategy is known)."""
        out: TimingsJSON = {
            "prompt_n": self.prompt_n,
            "cache_n": self.cache_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n else 0.0,
            "prompt_per_second": 1e3 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / self.predicted_n if self.predicted_n else 0.0,
            "predicted_per_second": (
                1e3 * self.predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0
            ),
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
            "draft_n_rejected": self.draft_n - self.draft_n_accepted,
            "draft_acceptance": self.draft_n_accepted / self.draft_n if self.draft_n else 0.0,
            "draft_windows": self.draft_windows,
            "draft_verify_ms": self.draft_verify_ms,
            "draft_verify_ms_per_window": (
                self.draft_verify_ms / self.draft_windows if self.draft_windows else 0.0
            ),
            "plain_steps": self.plain_steps,
            "draft_lookahead": self.draft_lookahead,
            "draft_lookahead_used": self.draft_lookahead_used,
            "draft_model_windows": self.draft_model_windows,
            "draft_model_n": self.draft_model_n,
            "draft_model_n_accepted": self.draft_model_n_accepted,
        }
        if self.spec_strategy:
            out |= {"spec_strategy": self.spec_strategy, "spec_state": self.spec_state,
                    "spec_window": self.spec_window}
        return out


@dataclass(frozen=True, slots=True)
class Admitted:
    """The engine tokenized and admitted the request; errors after this are in-band."""

    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token: str
    bytes: tuple[int, ...]
    logprob: float
    id: int = -1            # the token id (llama.cpp's completion_probabilities show it)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's logprob and its most likely alternatives (OpenAI's shape): a generated
    token's, or an echoed prompt token's (None for the first, which nothing precedes)."""

    token: str
    bytes: tuple[int, ...]
    logprob: float | None
    top: tuple[TopLogprob, ...] = ()
    id: int = -1


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New generated text (may be empty while a possible stop string is held back).

    ``index``: the choice it belongs to (requests with ``n`` > 1). ``logprobs``: when
    asked for, one entry per token whose text this delta releases."""

    text: str
    token_ids: tuple[int, ...] = ()
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Finished:
    """One choice ended (``index``); the request's last event is its last choice's.
    ``usage.completion_tokens`` counts this choice's tokens."""

    finish_reason: FinishReason
    usage: Usage
    timings: Timings = field(default_factory=Timings)
    index: int = 0


GenerationEvent: TypeAlias = Admitted | TextDelta | Finished


@runtime_checkable
class EngineClient(Protocol):
    """What the OpenAI layer needs from the engine side. See the module docstring."""

    def models(self) -> list[ModelCard]:
        """The models servable now (cheap, non-blocking; called on every request)."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Start generating; implement as ``async def generate(...)`` with ``yield``.

        Raises (before the first event): UnknownModelError, PromptTooLongError,
        InvalidRequestError, EngineUnavailableError. Later failures: EngineFailedError
        or any exception with a row in ERROR_TABLE (the engine's, the mesh's).
        The caller must exhaust or ``aclose()`` the iterator.
        """
        ...


class StopMatcher:
    """Sans-IO stop-string matcher for engine clients.

    Feed each piece of detokenized text; get back the text that is safe to emit now.
    Text that could be the start of a stop string is held back until it either completes
    the stop string (then ``stopped`` turns True and the held text is dropped) or can no
    longer match (then it is released). Call :meth:`flush` when generation ends for
    another reason to get the held tail.
    """

    __slots__ = ("_stops", "_held", "stopped")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Return the text to emit; afterwards check :attr:`stopped`."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[: min(hits)]
        keep = self._longest_partial(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back tail (empty after a stop). Call once when generation ends."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held

    def _longest_partial(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
