"""Stage 0's request loop: one model served to the OpenAI layer (an EngineClient).

Theory of operation
-------------------
``generate`` validates the sampling fields (every value the final stage can get must
sample: one request's bad value would otherwise fail every request of its batch), refuses
a request past ``parallel + max_queue`` admitted ones (:class:`~meshnode.serve.errors.
ServerBusyError`, a 429), refuses a prompt whose text alone proves it too long for the
context without tokenizing it, turns it into tokens (the GGUF's chat template; a long
prompt on the tokenizer's own thread, so the event loop that carries the mesh's
heartbeats stays free), refuses a prompt that does not fit the context, admits it as an
:class:`~meshnode.serve.request.ActiveRequest` and runs it in its own task, which

1. looks for a retained session whose tokens begin its prompt
   (:class:`~meshnode.serve.prefix_cache.PrefixCache`) and waits for one of
   ``parallel`` sequence slots (every stage holds that many; retained sessions hold
   slots too and give them up when none is free);
2. **prefills**: the KV of the shared prefix is copied from the retained session on
   every stage, then the rest of the prompt goes through the pipeline in chunks of
   ``n_batch`` rows; only the last chunk asks for logits, so earlier chunks stream
   through the stages while stage 0 computes the next one;
3. **decodes**: each step is one call of the model's
   :class:`~meshnode.serve.speculation.SpeculativeDecoder`, which sends ``[last]`` or a
   verify window to the :class:`~meshnode.serve.scheduler.BatchScheduler` (batched with
   the other active sessions) and decides about drafts and lookaheads;
4. streams text incrementally (UTF-8 safe), honours stop strings
   (:class:`~meshnode.serve.client.StopMatcher`), end-of-generation tokens and
   ``max_tokens``, and ends with :class:`~meshnode.serve.client.Finished` (usage, timings);
5. **fails over**: when the model's route is lost (``route``, a
   :class:`~meshnode.serve.failover.RouteGate` the model service drives), a step that
   failed as unavailable waits for the new route, replays the session's token history
   through it (:func:`~meshnode.serve.failover.replay_steps`) and sends the failed step
   again, so the stream goes on with no token lost or repeated; with no route the request
   ends with the re-plan's reason (a 503);
6. keeps a finished session in the prefix cache (its slot with it), or frees the
   session on every stage in ``finally``, which also runs when the HTTP
   client goes away. A failure is handed to the consumer as it is when
   :data:`~meshnode.serve.errors.ERROR_TABLE` has a row for its type (a session that
   outgrows its context is a 400, a lost stage a 503); anything else is logged and
   reported as :class:`~meshnode.serve.errors.EngineFailedError`.

:meth:`ModelServer.shutdown` (the node's SIGINT / SIGTERM) refuses new requests, waits
up to a grace for the admitted ones, then ends the rest by handing each consumer an
:class:`~meshnode.serve.errors.EngineUnavailableError` through the request's own event
queue, after the text it already produced: the OpenAI routes turn it into a final error
chunk and ``[DONE]`` (streams) or a 503 error JSON, as any in-band failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from meshnode.engine.tokenizer import Tokenizer
from meshnode.serve.client import (
    Admitted,
    Finished,
    GenerationEvent,
    GenerationRequest,
    ModelCard,
    StopMatcher,
    Timings,
    Usage,
)
from meshnode.limits import (
    MAX_BIAS, MAX_CHOICES, MAX_LOGIT_BIAS, MAX_PENALTY, MAX_REPEAT_PENALTY, MAX_TOP_LOGPROBS, MAX_VERIFY_WINDOW,
)
from meshnode.mesh.final import NO_COUNTS, Finalized, Sampling
from meshnode.mesh.logprobs import TokenLogprobs
from meshnode.mesh.pipeline import (
    Pipeline, PipelineFailedError, PipelineUnavailableError, Step, StepFailedError,
)
from meshnode.serve.errors import (
    EngineFailedError,
    EngineUnavailableError,
    InvalidRequestError,
    PromptTooLongError,
    ServeError,
    ServerBusyError,
    UnknownModelError,
    UnsupportedValueError,
    error_spec,
)
from meshnode.serve.fim import fim_reason, infill_tokens
from meshnode.serve.failover import RouteGate, replay_steps
from meshnode.serve.http_guard import DEFAULT_MAX_QUEUE
from meshnode.serve.prefix_cache import PrefixCache, Retained, common_prefix
from meshnode.serve.request import ActiveRequest, new_session_id, prediction_usage
from meshnode.serve.scheduler import BatchScheduler
from meshnode.serve.speculation import SpeculativeDecoder
from meshnode.serve.structured import compile_constraint
from meshnode.serve.tools import render_messages
from meshnode.spec.strategy import DraftProposer, SpecConfig
from meshnode.spec.window import StageCompute, chunk_invariant
from meshnode.state import RequestInfo, RequestStatus, RequestUpdated

log = logging.getLogger(__name__)

RECENT_REQUESTS = 50
# A prompt of more than n_ctx * MAX_CHARS_PER_TOKEN characters cannot fit, whatever the
# tokenizer: the longest token of SmolLM2's vocabulary is 81 characters (a newline and 80
# spaces), Gemma 3's 48 bytes. Checked before tokenizing megabytes for nothing.
MAX_CHARS_PER_TOKEN = 256
# Prompts up to this many characters are tokenized inline (well under a millisecond);
# longer ones on the tokenizer's thread.
INLINE_TOKENIZE_CHARS = 16_384
# a predicted output is matched against its answer inline up to this many tokens of both
INLINE_DIFF_TOKENS = 512
# Below this temperature sampling is greedy: logits divided by a denormal overflow to inf
# and the distribution turns NaN (the final stage would fail the whole batch).
MIN_TEMPERATURE = 1e-3
# above OpenAI's 2 (the API's bound), below float32's range (the wire's)
MAX_TEMPERATURE = 1e6
MAX_TOP_K = 2**31 - 1          # the wire's i32 (wire/messages.py Segment.top_k)
SEED_SPACE = 2**64             # the wire's u64 (Segment.seed)
# At shutdown, how long requests ended after the grace get to hand their error over
# (their consumers take it at once; this only bounds a stuck one).
END_WAIT_S = 0.5
# A step that failed as unreachable before the route's loss was declared waits this long
# for the declaration (the link's dead-peer watch), then fails as it is.
LOSS_WAIT_S = 3.0
# How long a request in flight waits for a re-plan to give the model a new route (the
# new stage may have to slice and load its range).
RECOVERY_WAIT_S = 120.0
MAX_FAILOVERS = 4              # per request: a route that keeps dying ends it
SHUTTING_DOWN = "This node is shutting down; the request was not served. Retry on another node."
ENDED_AT_SHUTDOWN = "This node is shutting down; the request was ended before it finished."


@dataclass
class ServeSettings:
    name: str
    n_ctx: int = 2048           # per request context
    n_batch: int = 64           # prefill chunk (every stage uses the same schedule)
    max_batch_rows: int = MAX_VERIFY_WINDOW
    parallel: int = 4           # sessions at once; later requests wait in a queue
    max_queue: int = DEFAULT_MAX_QUEUE   # requests waiting beyond parallel; more get a 429
    aliases: tuple[str, ...] = ()
    spec: SpecConfig | None = None
    # finished sessions kept for prefix reuse (serve/prefix_cache.py); None: the most.
    # At most parallel - 1, so a match always has a free slot to be copied into; with one
    # slot, one: a greedy match takes the kept session over whole (no copy, no second
    # slot: ModelServer._take_slot_for), any other request frees it first.
    prefix_cache: int | None = None

    @property
    def prefix_sessions(self) -> int:
        most = max(1, self.parallel - 1)
        return max(0, min(most if self.prefix_cache is None else self.prefix_cache, most))


@dataclass(eq=False)   # (found and removed by identity: a prompt is an array)
class _Leader:
    """A scored prompt in flight that later ones sharing its context wait for."""

    prompt: np.ndarray
    top: int                                  # the alternatives its scores keep
    done: asyncio.Event = field(default_factory=asyncio.Event)   # set once it is kept, or not


class ModelServer:
    """Implements :class:`meshnode.serve.client.EngineClient` for one coordinated model."""

    def __init__(self, settings: ServeSettings, tokenizer: Tokenizer, pipeline: Pipeline, *,
                 publish: Callable[[object], None] | None = None,
                 draft: DraftProposer | None = None) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.pipeline = pipeline
        self.scheduler = BatchScheduler(pipeline, max_rows=settings.max_batch_rows)
        self.route = RouteGate()   # driven by the model service (failover)
        self.resumed: deque[tuple[str, float, int]] = deque(maxlen=RECENT_REQUESTS)  # (id, ms, replayed)
        self.replay_mismatches = 0   # greedy replays whose KV predicted another token (a bug)
        self._publish = publish or (lambda ev: None)
        self._sessions: set[int] = set()   # session ids in use (random: new_session_id)
        # Every stage holds parallel sequence slots; requests beyond that queue here.
        self._slots = asyncio.Semaphore(settings.parallel)
        self._multi_slots = asyncio.Lock()   # one request with n > 1 gathers its slots at a time
        # Finished sessions kept for their KV; each holds one of the slots above until it
        # is evicted (for a live request that finds no free slot, LRU, or at a re-plan).
        self.prefix = PrefixCache(settings.prefix_sessions)
        self._reuse_align = 1   # positions a prefix copy is a multiple of (follow_route)
        # scored one-token prompts in flight, whose kept sessions later ones sharing their
        # context wait for (_leader_for)
        self._leading: list[_Leader] = []
        self._waiting = 0       # requests gathering slots: a finished session is not kept then
        self._freeing: set[asyncio.Task] = set()
        self._admitted = 0      # requests past the admission check and not yet finished
        self._idle = asyncio.Event()    # set while _admitted == 0 (shutdown waits for it)
        self._idle.set()
        self._channels: dict[str, asyncio.Queue] = {}   # each admitted request's event queue
        self._closing = False   # set by shutdown(): new requests are refused
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._active: dict[str, ActiveRequest] = {}
        self._recent: deque[RequestInfo] = deque(maxlen=RECENT_REQUESTS)
        # Read by the node's telemetry sampler (one point a second).
        self.tokens_out = 0
        self.last_ttft_ms: float | None = None
        self.last_tpot_ms: float | None = None
        self.created = int(time.time())
        self._decoder = SpeculativeDecoder(settings.spec, draft, scheduler=self.scheduler,
                                           tokenizer=tokenizer, n_ctx=settings.n_ctx, publish=self._publish)

    # ---- EngineClient -------------------------------------------------------------------

    def models(self) -> list[ModelCard]:
        return [ModelCard(id=self.settings.name, created=self.created, n_ctx=self.settings.n_ctx,
                          **model_capabilities(self.tokenizer))]

    # ---- the tokenizer endpoints (openai_routes: /tokenize, /detokenize, /tokenizer_info) --

    async def tokenize(self, model: str | None, text: str, add_bos: bool) -> list[int]:
        """``text``'s tokens (special tokens' texts parsed, as HF tokenizers do; a BOS
        first when ``add_bos`` and the model adds one)."""
        self._check_model(model)
        encode = functools.partial(self.tokenizer.encode, text, add_bos=add_bos and self.tokenizer.add_bos,
                                   special=True)
        return list(await self._text_work(len(text) <= INLINE_TOKENIZE_CHARS, encode))

    async def tokenize_chat(self, req: GenerationRequest, add_generation_prompt: bool) -> list[int]:
        """The prompt tokens of chat request ``req`` (its messages and tools through the
        chat template, as a chat completion lays them out)."""
        self._check_model(req.model or None)
        return (await self._tokenize(req, add_generation_prompt))[0]

    async def detokenize(self, model: str | None, tokens: list[int]) -> str:
        self._check_model(model)
        self._check_ids(tokens, "tokens")
        # special tokens' texts included, as vLLM's and llama.cpp's servers give them
        decode = functools.partial(self.tokenizer.decode, tokens, special=True)
        return await self._text_work(len(tokens) <= INLINE_DIFF_TOKENS, decode)

    def tokenizer_info(self, model: str | None) -> dict:
        """What a client needs to tokenize as the node does (vLLM's ``/tokenizer_info``)."""
        self._check_model(model)
        t = self.tokenizer
        return {"model": self.settings.name, "tokenizer_class": "GGUF (llama.cpp)",
                "eos_token": t.token_text(t.eos_id) if t.eos_id >= 0 else None,
                "bos_token": t.token_text(t.bos_id) if t.bos_id >= 0 else None,
                "pad_token": None, "add_bos_token": t.add_bos, "model_max_length": self.settings.n_ctx,
                "vocab_size": t.n_vocab, "chat_template": t.chat_template}

    def _check_model(self, name: str | None) -> None:
        """Raises UnknownModelError unless ``name`` is this model's (None: no name given)."""
        s = self.settings
        if name is not None and name.lower() not in {n.lower() for n in (s.name, *s.aliases)}:
            raise UnknownModelError(name)

    def _prompt_tokens(self, req: GenerationRequest, turn: bool = True) -> tuple[list[int], list[str]]:
        """``req``'s prompt tokens and its chat template's stop strings; ``turn``: a chat
        prompt ends with the assistant turn's opening."""
        if req.infill is not None:
            n_predict = -1 if req.max_tokens is None else req.max_tokens
            return infill_tokens(self.tokenizer, req.infill, n_ctx=self.settings.n_ctx, n_predict=n_predict), []
        if req.messages is not None:
            opts = {} if turn else {"add_generation_prompt": False}
            if req.tools or any(m.tool_calls or m.role == "tool" for m in req.messages):
                msgs, tools = render_messages(req.messages, req.tools, native=self.tokenizer.supports_tools)
                return self.tokenizer.apply_chat_template(msgs, tools, **opts)
            msgs = [{"role": m.role, "content": m.content} for m in req.messages]
            return self.tokenizer.apply_chat_template(msgs, **opts)
        if req.prompt_ids is not None:
            self._check_ids(req.prompt_ids, "prompt")
            return list(req.prompt_ids), []
        tokens = self.tokenizer.encode(req.prompt or "", add_bos=True)
        if not tokens:   # an empty text on a model that adds no BOS: nothing to continue from
            raise InvalidRequestError("prompt", "The prompt has no tokens (this model adds no BOS token to "
                                                "an empty text): give it some text.")
        return tokens, []

    def _check_ids(self, ids: Sequence[int], param: str) -> None:
        """Raises InvalidRequestError (``param``) for a token id outside the vocabulary."""
        n_vocab = getattr(self.tokenizer, "n_vocab", None)
        bad = next((t for t in ids if not 0 <= t < (n_vocab or 2**31)), None)
        if bad is not None:
            raise InvalidRequestError(param, f"Invalid token id in '{param}': {bad} (the model's "
                                             f"vocabulary has {n_vocab} tokens).")

    async def _tokenize(self, req: GenerationRequest, turn: bool = True) -> tuple[list[int], list[str]]:
        n_chars = (sum(len(m.content) for m in req.messages) if req.messages is not None
                   else req.infill.n_chars if req.infill is not None
                   else len(req.prompt_ids) if req.prompt_ids is not None else len(req.prompt or ""))
        n_ctx = self.settings.n_ctx
        if n_chars > n_ctx * MAX_CHARS_PER_TOKEN:
            raise PromptTooLongError(n_chars // MAX_CHARS_PER_TOKEN, n_ctx, at_least=True)
        return await self._text_work(n_chars <= INLINE_TOKENIZE_CHARS, self._prompt_tokens, req, turn)

    async def _text_work(self, inline: bool, fn, *args):
        """``fn(*args)``: here when ``inline`` (small: well under a millisecond), else on
        the tokenizer's thread. One thread, so long tokenizations (and the like) queue
        behind each other instead of taking every core; llama.cpp's tokenizer releases
        the GIL, the chat template yields it."""
        if inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    async def _prediction_tokens(self, req: GenerationRequest) -> list[int]:
        """The predicted output's tokens, at most a context's worth (a hint: the rest of a
        longer one is dropped, not refused)."""
        if not req.prediction:
            return []
        n_ctx = self.settings.n_ctx
        text = req.prediction[:n_ctx * MAX_CHARS_PER_TOKEN]
        encode = functools.partial(self.tokenizer.encode, text, add_bos=False, special=False)
        return list((await self._text_work(len(text) <= INLINE_TOKENIZE_CHARS, encode))[:n_ctx])

    async def _usage(self, ar: ActiveRequest) -> Usage:
        """``ar``'s usage; with a predicted output, how much of it the answer repeats
        (prediction_usage: about a microsecond a token, on the tokenizer's thread when long)."""
        if not ar.prediction:
            return Usage(len(ar.prompt), len(ar.generated))
        counts = await self._text_work(len(ar.prediction) + len(ar.generated) <= INLINE_DIFF_TOKENS,
                                       prediction_usage, ar.prediction, list(ar.generated))
        return Usage(len(ar.prompt), len(ar.generated), *counts)

    def _sampling(self, req: GenerationRequest) -> Sampling:
        return sampling_for(req, getattr(self.tokenizer, "n_vocab", None))

    def _admit(self, n: int = 1) -> None:
        self._admitted += n
        self._idle.clear()

    def _release(self, n: int = 1) -> None:
        self._admitted -= n
        if self._admitted == 0:
            self._idle.set()

    def _check_features(self, req: GenerationRequest) -> None:
        """Refuse what this model or node cannot do (400s, before admission)."""
        if req.infill is not None and (why := fim_reason(self.tokenizer)) is not None:
            raise UnsupportedValueError("suffix", f"{self.settings.name} {why}.")
        if not 1 <= req.n <= min(MAX_CHOICES, self.settings.parallel):
            raise InvalidRequestError("n", f"Invalid value for 'n': {req.n} (this node generates at most "
                                      f"{min(MAX_CHOICES, self.settings.parallel)} choices at once).")

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self._check_model(req.model)
        self._check_features(req)
        sampling = self._sampling(req)
        s = self.settings
        n = req.n
        if self._closing:
            raise EngineUnavailableError(SHUTTING_DOWN)
        if self._admitted + n > s.parallel + s.max_queue:
            raise ServerBusyError(
                f"All {s.parallel} slots and {s.max_queue} queue places of {s.name} are taken; "
                "retry shortly.", retry_after=1)
        self._admit(n)   # each choice holds a sequence slot on every stage
        try:
            prompt, template_stops = await self._tokenize(req)
            prediction = await self._prediction_tokens(req)
            constraints: list = [None] * n
            if req.structure is not None:
                # compiling a schema can take a while (and the first one builds the
                # grammar's view of the vocabulary): off the loop. One per choice: each
                # choice walks the grammar on its own.
                param = "tools" if req.structure.kind == "tool_calls" else "response_format"
                constraints = [await self._text_work(False, compile_constraint, req.structure, self.tokenizer, param)
                               for _ in range(n)]
        except BaseException:
            self._release(n)
            raise
        n_ctx = self.settings.n_ctx
        if len(prompt) > n_ctx:
            self._release(n)
            raise PromptTooLongError(len(prompt), n_ctx)
        if self._closing:   # shutdown began while the prompt was tokenized
            self._release(n)
            raise EngineUnavailableError(SHUTTING_DOWN)
        # The prompt holds positions [0, P); each generated token but the last is fed
        # back at the next position, so a context of n_ctx gives n_ctx - P + 1 tokens (a
        # prompt that fills the context still gets its one: what lm-eval's log-likelihood
        # of a window as long as the context asks for).
        budget = n_ctx - len(prompt) + 1
        max_tokens = budget if req.max_tokens is None else min(req.max_tokens, budget)
        echo = None
        if req.echo:   # the prompt as given (token ids: as the model reads them back)
            echo = req.prompt if req.prompt is not None else self.tokenizer.decode(prompt)
        ars: list[ActiveRequest] = []
        for i in range(n):
            # choice i samples with seed + i: different choices, each reproducible
            rid = req.request_id if i == 0 else f"{req.request_id}.{i}"
            info = RequestInfo(rid, self.settings.name, RequestStatus.QUEUED, len(prompt), 0, 0.0, None,
                               time.time(), strategy=self._decoder.telemetry.strategy)
            ar = ActiveRequest(rid, new_session_id(self._sessions), prompt,
                               replace(sampling, seed=(sampling.seed + i) % SEED_SPACE), max_tokens,
                               StopMatcher(tuple(req.stop) + tuple(template_stops)), info, index=i,
                               constraint=constraints[i], client=req.client, prediction=prediction,
                               echo=echo)
            self._active[rid] = ar
            self._update(ar)
            ars.append(ar)
        rid = req.request_id
        events: asyncio.Queue = asyncio.Queue()
        self._channels[rid] = events
        task: asyncio.Task | None = None
        try:
            yield Admitted(prompt_tokens=len(prompt))
            # The request runs in its own task and hands events over through a queue:
            # decoding never waits for the HTTP client to take the previous token, so every
            # session is ready for the next batch at once (continuous batching stays dense).
            task = asyncio.get_running_loop().create_task(self._produce(events, ars), name=f"request-{rid}")
            left = n
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Finished):
                    left -= 1
                    if not left:
                        return
        finally:
            try:
                if task is None:    # closed at Admitted: it never ran
                    for ar in ars:
                        self._finish(ar, RequestStatus.CANCELLED)
                else:
                    if not task.done():
                        task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            finally:
                self._channels.pop(rid, None)
                self._release(n)

    async def _acquire(self, n: int, ar: ActiveRequest | None = None) -> tuple[Retained, int] | None:
        """Take ``n`` sequence slots. One request at a time gathers several, so two
        requests each holding part of what they need never wait on each other. Retained
        sessions give their slots up when none is free: live requests come first. With
        ``ar`` (one slot), also the kept session to reuse its prompt's prefix from, pinned
        (:meth:`_take_slot_for`)."""
        self._waiting += 1
        try:
            if n == 1:
                return await self._take_slot_for(ar)
            async with self._multi_slots:
                taken = 0
                try:
                    for _ in range(n):
                        await self._take_slot()
                        taken += 1
                except BaseException:
                    for _ in range(taken):
                        self._slots.release()
                    raise
            return None
        finally:
            self._waiting -= 1

    def _lookup(self, ar: ActiveRequest | None) -> tuple[Retained, int] | None:
        if ar is None or not self.route.up:
            return None
        # (a scored prompt takes the copied prefix's scores from the entry: prefix_cache.py)
        return self.prefix.lookup(ar.prompt, self.route.epoch, ar.sampling.top_logprobs if ar.scoring else None,
                                  self._reuse_align)

    async def _take_slot_for(self, ar: ActiveRequest | None) -> tuple[Retained, int] | None:
        """One slot and the prefix hit for ``ar``'s prompt (pinned), if any. The entry
        we would copy from is not evicted for our slot. When no slot is free but the one
        that entry holds, and no other request is copying from it, a greedy request takes
        that session over whole (``ar.session`` becomes it: its KV, its slot, no copy; a
        sampled one would inherit the final stage's random state of that session).
        Otherwise a request that must wait waits without its pin: the pinned entry may
        be the last one kept, whose slot is the one that would come free (a burst of
        requests for one prompt, every other slot live); it looks again once it has its
        slot."""
        hit = self._lookup(ar)
        await self._make_room(hit[0] if hit is not None else None)
        if hit is not None and self._slots.locked():
            entry = hit[0]
            # (the entry may have been given up while _make_room waited: a re-plan)
            if (ar is not None and entry.pins == 1 and ar.sampling.greedy and not entry.removed
                    and entry.epoch == self.route.epoch):
                self.prefix.take(entry)
                self._sessions.discard(ar.session)   # never sent to a stage
                ar.session = entry.session
                return hit
            self._unpin(entry)     # frees it now if nobody else copies from it
            hit = None
        try:
            await self._slots.acquire()
        except BaseException:
            if hit is not None:
                self._unpin(hit[0])
            raise
        return hit if hit is not None else self._lookup(ar)

    async def _take_slot(self) -> None:
        await self._make_room()
        await self._slots.acquire()

    async def _make_room(self, keep: Retained | None = None) -> None:
        """While no slot is free, free kept sessions (but ``keep``), least recently used first."""
        while self._slots.locked() and (e := self.prefix.evict_one(keep)) is not None:
            await self._free_retained(e)

    async def _free_retained(self, e: Retained) -> None:
        """End a session the prefix cache gave up on every stage, then free its slot
        (even when the caller is cancelled meanwhile: the slot must come back)."""
        ends = asyncio.ensure_future(self._end_session(e.session))
        ends.add_done_callback(lambda _f: self._slots.release())
        await asyncio.shield(ends)

    def _free_later(self, entries: list[Retained]) -> None:
        for e in entries:
            t = asyncio.get_running_loop().create_task(self._free_retained(e))
            self._freeing.add(t)
            t.add_done_callback(self._freeing.discard)

    async def _produce(self, events: asyncio.Queue, ars: list[ActiveRequest]) -> None:
        """Prefill and decode one request's choices, putting their events on ``events``."""
        # (n > 1 choices share their prompt among themselves: no lookup, nothing kept)
        try:
            lead = self._leader_for(ars)
            if lead is not None:
                await lead.wait()
            hit = await self._acquire(len(ars), ars[0] if len(ars) == 1 else None)
        except BaseException:
            for ar in ars:
                self._finish(ar, RequestStatus.CANCELLED)
            raise
        leading = self._lead(ars)
        completed = False
        for ar in ars:
            ar.info = replace(ar.info, status=RequestStatus.PREFILL)
        decoder = self._decoder
        try:
            t_prefill = time.perf_counter()
            firsts = await self._prefill_failover(ars, hit)
            for ar, first in zip(ars, firsts):
                if ar.constraint is not None:
                    ar.constraint.commit([first.tokens[-1]])
            prefill_s = time.perf_counter() - t_prefill
            if len(ars) == 1:
                await self._decode(events, ars[0], firsts[0], prefill_s)
            else:
                await _all_or_none([self._decode(events, ar, first, prefill_s)
                                    for ar, first in zip(ars, firsts)])
            completed = True
        except asyncio.CancelledError:
            for ar in ars:
                self._finish(ar, RequestStatus.CANCELLED)
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, typed
            for ar in ars:
                self._finish(ar, RequestStatus.ERROR)
            if error_spec(exc) is None:
                log.exception("request %s failed", ars[0].id)
                exc = EngineFailedError(f"generation failed: {exc}")
            elif not isinstance(exc, ServeError):
                log.warning("request %s failed: %s: %s", ars[0].id, type(exc).__name__, exc)
            events.put_nowait(exc)
        finally:
            for ar in ars:
                ar.withdraw_lookahead()
                self.scheduler.leave(ar.session)
                decoder.telemetry.end_request(ar.id)
                decoder.end(ar)
            # A kept session (and its slot) now belongs to the prefix cache. Otherwise the
            # slots come back once every stage was told to free the sessions (even
            # when this task is cancelled meanwhile): the next request's steps then
            # reach each stage behind the SessionEnds, never beside KV still held.
            try:
                kept = completed and len(ars) == 1 and self._retain(ars[0])
            finally:
                if leading is not None:   # those waiting for this prompt look for it now
                    leading.done.set()
                    self._leading.remove(leading)
            if not kept:
                ends = asyncio.ensure_future(asyncio.gather(*(self._end_session(ar.session) for ar in ars)))
                ends.add_done_callback(lambda _f, n=len(ars): self._release_slots(n))
                await asyncio.shield(ends)

    def _shares_scores(self, ars: list[ActiveRequest]) -> bool:
        """Whether the request is one scored prompt that the prefix cache may keep."""
        return len(ars) == 1 and ars[0].scoring and bool(self.prefix.capacity)

    def _leader_for(self, ars: list[ActiveRequest]) -> asyncio.Event | None:
        """What a scored prompt waits for before it looks for a kept session: a scored
        prompt in flight that shares its context (more than ``MIN_PREFIX`` tokens) with at
        least as many alternatives, so that an evaluation harness's answer choices, sent
        at once by concurrent clients, compute the context once (a batch's prompts wait
        so already: serve/batched.py). None: go on."""
        if not self._leading or not self._shares_scores(ars):
            return None
        arr = np.asarray(ars[0].prompt, dtype=np.int32)
        top = ars[0].sampling.top_logprobs or 0
        return next((x.done for x in self._leading
                     if x.top >= top and common_prefix(arr, x.prompt) > self.prefix.min_prefix), None)

    def _lead(self, ars: list[ActiveRequest]) -> _Leader | None:
        """Register a scored prompt that ends with its prefill (at most one token) as one
        that others may wait for (:meth:`_leader_for`); its entry is removed and set when
        it is kept or not."""
        ar = ars[0]
        if not self._shares_scores(ars) or ar.remaining > 1:
            return None
        entry = _Leader(np.asarray(ar.prompt, dtype=np.int32), ar.sampling.top_logprobs or 0)
        self._leading.append(entry)
        return entry

    def _retain(self, ar: ActiveRequest) -> bool:
        """Keep ``ar``'s finished session in the prefix cache; False when it is not kept
        (cache off, a request waits for a slot, the route changed, shutting down)."""
        if (not self.prefix.capacity or self._waiting or self._closing
                or ar.epoch != self.route.epoch or not self.route.up):
            return False
        # The KV holds positions [0, pos): the prompt and every fed token; the last
        # sampled token was never fed, and positions past pos (rejected drafts, a
        # withdrawn lookahead) are cut by the copy.
        history = [*ar.prompt, *ar.generated][:ar.pos]
        if len(history) != ar.pos:
            return False
        scores, top = None, 0
        if ar.scoring and sum(len(s.logprobs) for s in ar.scores) == len(ar.prompt) - 1:
            scores, top = TokenLogprobs.concat(ar.scores), ar.sampling.top_logprobs or 0
        freed = self.prefix.put(ar.session, history, ar.epoch, scores, top, prefilled=len(ar.prompt))
        kept = all(e.session != ar.session for e in freed)
        self._free_later([e for e in freed if e.session != ar.session])
        return kept

    def _unpin(self, e: Retained) -> None:
        self.prefix.unpin(e)
        if self._waiting and not e.pins and not e.removed:
            # a request may have found no slot to take while this one was being copied
            self._free_later([x for x in [self.prefix.evict_one()] if x is not None])

    def _release_slots(self, n: int) -> None:
        for _ in range(n):
            self._slots.release()

    async def _decode(self, events: asyncio.Queue, ar: ActiveRequest, first: Finalized, prefill_s: float) -> None:
        """Decode one choice from its first token to its end; its Finished event last."""
        decoder = self._decoder
        decoder.telemetry.record_prompt(ar.id, len(ar.prompt) - ar.cached, prefill_s)   # evaluated
        ar.first_token_t = time.perf_counter()
        first_token = first.tokens[-1]
        ar.pos = len(ar.prompt)
        if ar.echo is not None:
            events.put_nowait(ar.echo_delta(self.tokenizer))
        pending, lps = [first_token], first.logprobs
        t_decode = time.perf_counter()
        self.scheduler.enter(ar.session)
        started = False
        while True:
            # emit what the last step produced
            for delta in ar.take(pending, self.tokenizer, lps):
                events.put_nowait(delta)
            self._progress(ar)
            if ar.done:
                break
            if not started:
                # after the first token is out: the proposers' start (a draft model's
                # prefill of the prompt) is not what the client waits for it
                await decoder.start(ar, first_token)
                started = True
            pending = await self._decode_step(ar, pending[-1])
            lps = ar.last_logprobs
            ar.pos += len(pending)  # last + accepted drafts entered the KV
        if (tail := ar.tail_delta()) is not None:
            events.put_nowait(tail)
        decoder.remember(ar)
        decode_s = time.perf_counter() - t_decode
        counters, now = decoder.telemetry.counters(ar.id), decoder.telemetry.snapshot()
        self._finish(ar, RequestStatus.DONE)
        n_prompt, n_gen = len(ar.prompt), len(ar.generated)
        events.put_nowait(Finished(ar.finish, await self._usage(ar), Timings(
            prompt_n=n_prompt - ar.cached, cache_n=ar.cached, prompt_ms=1e3 * prefill_s, predicted_n=n_gen,
            predicted_ms=1e3 * decode_s, draft_n=counters.proposed,
            draft_n_accepted=counters.accepted, draft_windows=counters.windows,
            draft_verify_ms=1e3 * counters.verify_s, plain_steps=counters.plain_steps,
            draft_lookahead=counters.lookahead, draft_lookahead_used=counters.lookahead_used,
            draft_model_windows=counters.model_windows, draft_model_n=counters.model_proposed,
            draft_model_n_accepted=counters.model_accepted, spec_strategy=now.strategy, spec_state=now.state.value,
            spec_window=now.current_window), index=ar.index))

    # ---- steps --------------------------------------------------------------------------

    async def _prefill(self, ar: ActiveRequest, hit: tuple[Retained, int] | None = None) -> Finalized:
        """The prompt in chunks of n_batch; with ``hit`` (a retained session and how
        many of its positions match the prompt) those positions are copied into
        ``ar``'s session on every stage first and only the rest is computed."""
        arr = np.asarray(ar.prompt, dtype=np.int32)
        ar.epoch = self.route.epoch
        begin = 0
        ar.scores = []
        taken = hit is not None and hit[0].session == ar.session
        if hit is not None and hit[0].epoch == ar.epoch and (taken or not hit[0].removed):
            # A session taken over whole needs no copy: every stage cuts its KV past the
            # shared prefix when the first chunk starts before it (forward(rewind=True)).
            entry, n = hit
            if not taken:
                await self.pipeline.copy_session(entry.session, ar.session, n)
            self.prefix.used(*hit)
            begin = ar.cached = n
            if ar.scoring:   # (lookup gave an entry with these scores)
                assert entry.scores is not None
                ar.scores = [entry.scores.head(n, ar.sampling.top_logprobs or 0)]
        result = await self._prefill_chunks(ar, arr, begin, len(arr))
        assert result is not None
        return result

    async def _prefill_chunks(self, ar: ActiveRequest, arr: np.ndarray, begin: int,
                              end: int) -> Finalized | None:
        """``ar``'s prompt positions [begin, end) in chunks of n_batch; the last row of
        the prompt (when ``end`` reaches it) samples the first token, with ``ar``'s
        constraint's mask. When
        ``ar`` scores its prompt (echo), each chunk's rows are scored against the
        prompt's next tokens and the scores go to ``ar.scores`` in order.

        A chunk without logits returns once stage 0 has sent it, so the stages of a split
        work on consecutive chunks at once; a scored chunk returns with its scores from
        the final stage, so up to one scored chunk per stage is queued ahead of the one
        awaited, to keep that overlap (no more: other requests' steps queue behind them)."""
        nb = self.settings.n_batch
        depth = max(1, self.pipeline.n_stages) if ar.scoring else 1
        ahead: deque[tuple[asyncio.Future, bool]] = deque()
        result = None
        try:
            for start in range(begin, end, nb):
                tokens = arr[start:min(start + nb, end)]
                sample = start + len(tokens) == len(ar.prompt)
                score = _score(ar, start, start + len(tokens))
                mask = ar.constraint.masks() if sample and ar.constraint is not None else None
                step = Step(ar.session, start, tokens, len(score) + sample, (), ar.sampling, mask, score=score,
                            # (the first token's penalties: a repetition penalty sees the prompt)
                            seen=ar.seen_before(len(ar.prompt) - 1) if sample else NO_COUNTS)
                ahead.append((self.scheduler.enqueue(step, ar.epoch), bool(score)))
                while len(ahead) >= depth:
                    result = await self._chunk_done(ar, *ahead.popleft())
            while ahead:
                result = await self._chunk_done(ar, *ahead.popleft())
        finally:
            for fut, _ in ahead:   # withdrawn (those not sent yet are never run)
                if fut.done() and not fut.cancelled():
                    fut.exception()    # (failed with the one raised: retrieved, not logged as lost)
                fut.cancel()
        return result

    @staticmethod
    async def _chunk_done(ar: ActiveRequest, fut: asyncio.Future, scored: bool) -> Finalized | None:
        result = await fut
        if scored:
            assert result is not None and result.scored is not None
            ar.scores.append(result.scored)
        return result

    async def _prefill_shared(self, ars: list[ActiveRequest]) -> list[Finalized]:
        """Several choices of one prompt: the prompt but its last token is prefilled once
        (the first choice's session) and its KV shared with the other choices' sessions
        on every stage; then each choice feeds the last token itself and samples its
        first token with its own generator. On a GPU route (``_reuse_align``) the shared
        part ends at a chunk boundary and each choice computes the last, partial chunk,
        so every row is computed in the chunk a single choice computes it in (see
        serve/prefix_cache.py): a greedy choice is the one-choice answer there too."""
        for ar in ars:
            ar.epoch = self.route.epoch
        prompt = np.asarray(ars[0].prompt, dtype=np.int32)
        shared = (len(prompt) - 1) // self._reuse_align * self._reuse_align
        ars[0].scores = []
        await self._prefill_chunks(ars[0], prompt, 0, shared)
        for ar in ars[1:]:
            ar.scores = list(ars[0].scores)
        if shared:
            for ar in ars[1:]:
                await self.pipeline.copy_session(ars[0].session, ar.session, shared)
        results = await asyncio.gather(*(
            self._prefill_chunks(ar, prompt, shared, len(prompt)) for ar in ars))
        return [r for r in results if r is not None]

    # ---- failover -------------------------------------------------------------------------

    async def _prefill_failover(self, ars: list[ActiveRequest],
                                hit: tuple[Retained, int] | None = None) -> list[Finalized]:
        """The prefill of one request's choices (their first tokens); when the route is
        lost under it, again on the new route (in full: a retained session's KV stayed on
        the old route)."""
        pinned = hit
        try:
            for attempt in range(MAX_FAILOVERS + 1):
                try:
                    if len(ars) == 1:
                        return [await self._prefill(ars[0], hit)]
                    return await self._prefill_shared(ars)
                except (PipelineUnavailableError, PipelineFailedError) as exc:
                    hit = None
                    for ar in ars:
                        ar.cached = 0
                    if attempt == MAX_FAILOVERS or not await self._route_lost(ars[0], exc):
                        raise
                    t0 = time.perf_counter()
                    await self._new_route(ars[0])
                    log.info("request %s: prefill restarts on the new route (waited %.0f ms)",
                             ars[0].id, 1e3 * (time.perf_counter() - t0))
            raise AssertionError("unreachable")
        finally:
            if pinned is not None:
                self._unpin(pinned[0])

    async def _decode_step(self, ar: ActiveRequest, last: int) -> list[int]:
        """One decode step; when the route is lost under it, the session is replayed on
        the new route and the step sent again (the replay itself may meet the next loss)."""
        lost = False
        for attempt in range(MAX_FAILOVERS + 1):
            try:
                if lost:
                    await self._resume(ar, last)
                return await self._decoder.step(ar, last)
            except (PipelineUnavailableError, PipelineFailedError) as exc:
                if attempt == MAX_FAILOVERS or not await self._route_lost(ar, exc):
                    raise
                lost = True
        raise AssertionError("unreachable")

    async def _route_lost(self, ar: ActiveRequest, exc: Exception) -> bool:
        """Whether ``exc`` came from the loss of the route ``ar`` runs on (then it resumes).
        A route that changed since ``ar``'s step was sent explains any failure of it: a
        stage of the new route may refuse a step of the old one."""
        if self._closing:
            return False   # the node is stopping
        if self.route.changed_since(ar.epoch):
            return True
        if isinstance(exc, StepFailedError):
            return False   # this session's own failure
        # A send that found the link gone may come before the link's loss is declared.
        return isinstance(exc, PipelineUnavailableError) and await self.route.wait_lost(ar.epoch, LOSS_WAIT_S)

    async def _new_route(self, ar: ActiveRequest) -> None:
        """Wait for the re-plan; ``ar`` then runs on the new route (its KV is empty there)."""
        try:
            ar.epoch = await self.route.wait_up(RECOVERY_WAIT_S)
        except PipelineUnavailableError as exc:
            # Not a pipeline error any more: the request ends with it, it does not retry.
            raise EngineUnavailableError(str(exc)) from None

    async def _resume(self, ar: ActiveRequest, last: int) -> None:
        """Rebuild ``ar``'s KV on the new route: its token history up to ``ar.pos``
        (``last``, the newest token, is fed by the step sent again afterwards)."""
        t0 = time.perf_counter()
        ar.withdraw_lookahead()
        ar.ahead = None
        await self._new_route(ar)
        history = [*ar.prompt, *ar.generated][:ar.pos]
        if len(history) != ar.pos or ar.generated[-1] != last:
            raise EngineFailedError(f"generation failed: cannot replay request {ar.id} (history of "
                                    f"{len(history)} tokens, position {ar.pos})")
        # (a constrained request's token came from masked logits: the unmasked replay
        # cannot be checked against it)
        greedy = ar.sampling.greedy and ar.constraint is None
        result = None
        for step in replay_steps(ar.session, history, len(ar.prompt), self.settings.n_batch,
                                 rows_at=self._decoder.exact_rows_at, sampling=ar.sampling,
                                 check_last=greedy):
            result = await self.scheduler.submit(step, ar.epoch)
        if greedy and (result is None or result.tokens[-1] != last):
            # The replayed KV predicts another token than the lost route did: the new
            # route is not bit-identical (engine settings differ between the stages?).
            self.replay_mismatches += 1
            log.warning("request %s: the replay on the new route predicts token %s, the lost route gave %s",
                        ar.id, None if result is None else result.tokens[-1], last)
        ms = 1e3 * (time.perf_counter() - t0)
        self.resumed.appendleft((ar.id, ms, len(history)))
        log.info("request %s resumed on the new route after %.0f ms (%d tokens replayed)", ar.id, ms, len(history))

    def switch_pipeline(self, pipeline: Pipeline) -> None:
        """The model service re-planned: later steps run on ``pipeline``; requests that
        waited for it resume (their steps for the old route fail and replay)."""
        self.pipeline = pipeline
        self.scheduler.set_pipeline(pipeline)
        self.route.restored()
        # Retained KV was computed on the old route: forgotten (the SessionEnds reach
        # the stages that survived; the others lost it with their engines).
        self._free_later(self.prefix.drop_stale(self.route.epoch))

    def follow_route(self, stages: Sequence[StageCompute]) -> None:
        """The route is now ``stages``: speculation's verify windows follow what all of
        them compute exactly (at start and after every re-plan), and so does prefix
        reuse (whole prefill chunks only with a GPU stage: serve/prefix_cache.py)."""
        self._decoder.follow_route(stages)
        self._reuse_align = 1 if chunk_invariant(stages) else self.settings.n_batch

    @property
    def sessions_held(self) -> int:
        """Sessions whose KV stage 0 holds (each until every stage was told to free it),
        the prefix cache's included."""
        return len(self._sessions)

    def prefix_stats(self) -> dict[str, int]:
        """The prefix cache's counters and size (``status --json``)."""
        return {"capacity": self.prefix.capacity, "sessions": len(self.prefix), "align": self._reuse_align,
                **self.prefix.stats.as_dict()}

    async def drop_prefix_cache(self) -> None:
        """Free every retained session on every stage."""
        await asyncio.gather(*(self._free_retained(e) for e in self.prefix.clear()))
        if self._freeing:
            await asyncio.gather(*self._freeing, return_exceptions=True)

    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished (running or waiting for a slot)."""
        return self._admitted

    async def wait_idle(self) -> None:
        """Return once no request is admitted."""
        await self._idle.wait()

    async def _end_session(self, session: int) -> None:
        try:
            await self.pipeline.end_session(session)
        except Exception:  # noqa: BLE001 - freeing must not mask the real outcome
            log.debug("end_session(%s) failed", session, exc_info=True)
        finally:
            self._sessions.discard(session)

    # ---- telemetry ----------------------------------------------------------------------

    def _update(self, ar: ActiveRequest) -> None:
        self._publish(RequestUpdated(ar.info))

    def _progress(self, ar: ActiveRequest) -> None:
        n = len(ar.generated)
        elapsed = time.perf_counter() - (ar.first_token_t or ar.t0)
        ttft = None if ar.first_token_t is None else 1e3 * (ar.first_token_t - ar.t0)
        tps = (n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0
        self.tokens_out += n - ar.info.generated_tokens
        self.last_ttft_ms = ttft if ttft is not None else self.last_ttft_ms
        if tps:
            self.last_tpot_ms = 1e3 / tps
        ar.info = replace(ar.info, status=RequestStatus.DECODING, generated_tokens=n, tokens_per_s=tps, ttft_ms=ttft)

    def _finish(self, ar: ActiveRequest, status: RequestStatus) -> None:
        if ar.id not in self._active:
            return
        del self._active[ar.id]
        ar.info = replace(ar.info, status=status, finished_at=time.time())
        self._recent.appendleft(ar.info)
        self._update(ar)

    def requests(self) -> tuple[RequestInfo, ...]:
        return tuple(r.info for r in self._active.values()) + tuple(self._recent)

    def spec_stats(self):
        return (self._decoder.stats(),)

    def recent_drafts(self):
        return self._decoder.telemetry.recent()

    async def shutdown(self, grace: float) -> int:
        """Node shutdown: refuse new requests (:class:`EngineUnavailableError`, a 503),
        give the admitted ones up to ``grace`` seconds to finish, then end the rest with
        an EngineUnavailableError (:data:`ENDED_AT_SHUTDOWN`) after the text they already
        produced. Returns how many were ended; takes at most ``grace`` + :data:`END_WAIT_S`."""
        self._closing = True
        t0 = time.monotonic()
        with contextlib.suppress(Exception):   # kept sessions first: nothing will reuse them
            await asyncio.wait_for(self.drop_prefix_cache(), grace)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), max(0.0, grace - (time.monotonic() - t0)))
        if self._idle.is_set():
            return 0
        ended = list(self._channels.values())
        for events in ended:
            # The consumer raises it when it gets there (generate's finally then cancels
            # the request's task and frees its session on every stage).
            events.put_nowait(EngineUnavailableError(ENDED_AT_SHUTDOWN))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), END_WAIT_S)
        return len(ended)

    async def close(self) -> None:
        await self.scheduler.close()
        await self.pipeline.close()
        await self._decoder.close()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)


async def _all_or_none(work: list) -> None:
    """Run ``work`` concurrently; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def model_capabilities(tokenizer: object) -> dict:
    """``ModelCard`` fields naming what a model served here supports, and why not."""
    # tools and structured output work on every model: a template without tools gets the
    # documented fallback prompt, and the grammar is built from the GGUF vocabulary
    caps = ["completions", "chat", "logprobs", "n", "stream", "tools", "structured_output"]
    unsupported: list[tuple[str, str]] = []
    if (why := fim_reason(tokenizer)) is None:
        caps.append("fim")
    else:
        unsupported.append(("fim", why))
    return {"capabilities": tuple(caps), "unsupported": tuple(unsupported)}


def sampling_for(req: GenerationRequest, n_vocab: int | None = None) -> Sampling:
    """The final stage's :class:`Sampling` for ``req``; raises InvalidRequestError.

    Every value that comes out samples without error (the final stage runs a whole batch
    at once, so one value that raises there fails every request beside it): seed None or
    -1 is random (llama.cpp's and many clients' spelling), another negative seed is taken
    modulo 2**64; top_k <= 0 or >= the vocabulary is off; top_p <= 0 and temperatures
    below MIN_TEMPERATURE are greedy.

    Temperature, top_p, min_p, biases and penalties are rounded to float32: the wire
    carries them so, and one node sampling with the very values a split's final stage gets
    draws the same tokens (a top_p of 1e-300 would otherwise reach the final stage as 0,
    which no sampler takes)."""
    t, p = req.temperature, req.top_p
    if not (isinstance(t, (int, float)) and math.isfinite(t) and 0 <= t <= MAX_TEMPERATURE):
        raise InvalidRequestError("temperature", f"Invalid value for 'temperature': {t!r} "
                                  f"(expected 0..{MAX_TEMPERATURE:g}).")
    if not (isinstance(p, (int, float)) and math.isfinite(p) and p <= 1):
        raise InvalidRequestError("top_p", f"Invalid value for 'top_p': {p!r} (expected 0..1).")
    t, p = _f32(t), _f32(p)
    min_p = req.min_p
    if not (isinstance(min_p, (int, float)) and 0 <= min_p <= 1):
        raise InvalidRequestError("min_p", f"Invalid value for 'min_p': {min_p!r} (expected 0..1).")
    top_k = req.top_k or 0
    if top_k > MAX_TOP_K:
        raise InvalidRequestError("top_k", f"Invalid value for 'top_k': {top_k} (expected at most {MAX_TOP_K}).")
    if top_k < 0 or (n_vocab and top_k >= n_vocab):
        top_k = 0
    seed = req.seed
    if seed is None or seed == -1:
        seed = secrets.randbits(32)
    elif not -SEED_SPACE // 2 <= seed < SEED_SPACE:
        raise InvalidRequestError("seed", f"Invalid value for 'seed': {seed} (expected a 64-bit integer).")
    lp = req.logprobs
    if lp is not None and not 0 <= lp <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError("top_logprobs", f"Invalid value for 'top_logprobs': {lp} "
                                  f"(expected 0..{MAX_TOP_LOGPROBS}).")
    ids, values = _bias(req.logit_bias, n_vocab)
    penalties = {}
    for name, v in (("presence", req.presence_penalty), ("frequency", req.frequency_penalty)):
        if not (isinstance(v, (int, float)) and -MAX_PENALTY <= v <= MAX_PENALTY):
            raise InvalidRequestError(f"{name}_penalty", f"Invalid value for '{name}_penalty': {v!r} "
                                      f"(expected -{MAX_PENALTY:g}..{MAX_PENALTY:g}).")
        penalties[name] = _f32(v)
    r, last_n = req.repetition_penalty, req.repeat_last_n
    if not (isinstance(r, (int, float)) and 0 < r <= MAX_REPEAT_PENALTY):
        raise InvalidRequestError("repetition_penalty", f"Invalid value for 'repetition_penalty': {r!r} "
                                  f"(expected above 0, at most {MAX_REPEAT_PENALTY:g}; 1: off).")
    if not (isinstance(last_n, int) and last_n >= -1):
        raise InvalidRequestError("repeat_last_n", f"Invalid value for 'repeat_last_n': {last_n!r} "
                                  "(expected -1: the whole context, 0: off, or a count of tokens).")
    if _f32(r) != 1.0 and last_n:
        penalties.update(repeat=_f32(r), repeat_last_n=last_n)
    common = dict(seed=seed % SEED_SPACE, top_logprobs=lp, bias_ids=ids, bias_values=values, **penalties)
    if t < MIN_TEMPERATURE or p <= 0:
        return Sampling(temperature=0.0, top_k=0, top_p=1.0, **common)
    return Sampling(temperature=t, top_k=top_k, top_p=p, min_p=_f32(min_p), **common)


def _f32(x: float) -> float:
    """``x`` at the wire's float32 precision (sampling_for: one node samples as a split does)."""
    return float(np.float32(x))


def _bias(pairs: tuple[tuple[int, float], ...], n_vocab: int | None) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """``logit_bias`` pairs as :class:`Sampling`'s ascending ids and their values (zero
    biases dropped); raises InvalidRequestError for a token outside the vocabulary."""
    if len(pairs) > MAX_LOGIT_BIAS:
        raise InvalidRequestError("logit_bias", f"'logit_bias' has {len(pairs)} entries (at most {MAX_LOGIT_BIAS}).")
    bias: dict[int, float] = {}
    for tok, v in pairs:
        if not 0 <= tok < (n_vocab or 2**32):
            raise InvalidRequestError("logit_bias", f"Invalid token id in 'logit_bias': {tok} (the model's "
                                      f"vocabulary has {n_vocab} tokens).")
        if not (math.isfinite(v) and -MAX_BIAS <= v <= MAX_BIAS):
            raise InvalidRequestError("logit_bias", f"Invalid bias for token {tok}: {v!r} (expected "
                                      f"-{MAX_BIAS:g}..{MAX_BIAS:g}).")
        if v:
            bias[tok] = _f32(v)
    ids = tuple(sorted(bias))
    return ids, tuple(bias[i] for i in ids)


def _score(ar: ActiveRequest, start: int, end: int) -> tuple[int, ...]:
    """The prompt tokens a chunk of ``ar``'s prompt at [start, end) is scored against:
    those after each of its rows, when the request scores its prompt (echo)."""
    return tuple(ar.prompt[start + 1:end + 1]) if ar.scoring else ()
