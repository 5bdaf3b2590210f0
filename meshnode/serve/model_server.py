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

1. waits for one of ``parallel`` sequence slots (every stage holds that many);
2. **prefills**: the prompt goes through the pipeline in chunks of ``n_batch`` rows;
   only the last chunk asks for logits, so earlier chunks stream through the stages
   while stage 0 computes the next one;
3. **decodes**: each step is one call of the model's
   :class:`~meshnode.serve.speculation.SpeculativeDecoder`, which sends ``[last]`` or a
   verify window to the :class:`~meshnode.serve.scheduler.BatchScheduler` (batched with
   the other active sessions) and decides about drafts and lookaheads;
4. streams text incrementally (UTF-8 safe), honours stop strings
   (:class:`~meshnode.serve.client.StopMatcher`), end-of-generation tokens and
   ``max_tokens``, and ends with :class:`~meshnode.serve.client.Finished` (usage, timings);
5. frees the session on every stage in ``finally``, which also runs when the HTTP
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
import logging
import math
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import numpy as np

from meshnode.engine.tokenizer import Tokenizer
from meshnode.serve.client import (
    Admitted,
    Finished,
    GenerationEvent,
    GenerationRequest,
    ModelCard,
    StopMatcher,
    TextDelta,
    Timings,
    Usage,
)
from meshnode.limits import MAX_VERIFY_WINDOW
from meshnode.mesh.final import Sampling
from meshnode.mesh.pipeline import Pipeline, Step
from meshnode.serve.errors import (
    EngineFailedError,
    EngineUnavailableError,
    InvalidRequestError,
    PromptTooLongError,
    ServeError,
    ServerBusyError,
    UnknownModelError,
    error_spec,
)
from meshnode.serve.http_guard import DEFAULT_MAX_QUEUE
from meshnode.serve.request import ActiveRequest, new_session_id
from meshnode.serve.scheduler import BatchScheduler
from meshnode.serve.speculation import SpeculativeDecoder
from meshnode.serve.structured import compile_constraint
from meshnode.serve.tools import render_messages
from meshnode.spec.ngram import MIN_NGRAM_MATCH
from meshnode.spec.strategy import Proposer, SpecConfig
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
# Below this temperature sampling is greedy: logits divided by a denormal overflow to inf
# and the distribution turns NaN (the final stage would fail the whole batch).
MIN_TEMPERATURE = 1e-3
MAX_TOP_K = 2**31 - 1          # the wire's i32 (wire/messages.py Segment.top_k)
SEED_SPACE = 2**64             # the wire's u64 (Segment.seed)
# At shutdown, how long requests ended after the grace get to hand their error over
# (their consumers take it at once; this only bounds a stuck one).
END_WAIT_S = 0.5
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


class ModelServer:
    """Implements :class:`meshnode.serve.client.EngineClient` for one coordinated model."""

    def __init__(self, settings: ServeSettings, tokenizer: Tokenizer, pipeline: Pipeline, *,
                 publish: Callable[[object], None] | None = None,
                 draft: Proposer | None = None) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.pipeline = pipeline
        self.scheduler = BatchScheduler(pipeline, max_rows=settings.max_batch_rows)
        self._publish = publish or (lambda ev: None)
        self._sessions: set[int] = set()   # session ids in use (random: new_session_id)
        # Every stage holds parallel sequence slots; requests beyond that queue here.
        self._slots = asyncio.Semaphore(settings.parallel)
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
                                           tokenizer=tokenizer, n_ctx=settings.n_ctx,
                                           min_match=MIN_NGRAM_MATCH, publish=self._publish)

    # ---- EngineClient -------------------------------------------------------------------

    def models(self) -> list[ModelCard]:
        return [ModelCard(id=self.settings.name, created=self.created, n_ctx=self.settings.n_ctx)]

    def _check_model(self, name: str) -> None:
        s = self.settings
        if name.lower() not in {n.lower() for n in (s.name, *s.aliases)}:
            raise UnknownModelError(name)

    def _prompt_tokens(self, req: GenerationRequest) -> tuple[list[int], list[str]]:
        if req.messages is not None:
            if req.tools or any(m.tool_calls or m.role == "tool" for m in req.messages):
                msgs, tools = render_messages(req.messages, req.tools, native=self.tokenizer.supports_tools)
                return self.tokenizer.apply_chat_template(msgs, tools)
            msgs = [{"role": m.role, "content": m.content} for m in req.messages]
            return self.tokenizer.apply_chat_template(msgs)
        return self.tokenizer.encode(req.prompt or "", add_bos=True), []

    async def _tokenize(self, req: GenerationRequest) -> tuple[list[int], list[str]]:
        n_chars = (sum(len(m.content) for m in req.messages) if req.messages is not None
                   else len(req.prompt or ""))
        n_ctx = self.settings.n_ctx
        if n_chars > n_ctx * MAX_CHARS_PER_TOKEN:
            raise PromptTooLongError(n_chars // MAX_CHARS_PER_TOKEN, n_ctx, at_least=True)
        if n_chars <= INLINE_TOKENIZE_CHARS:
            return self._prompt_tokens(req)
        # One thread, so tokenizations queue behind each other instead of taking every
        # core; llama.cpp's tokenizer releases the GIL, the chat template yields it.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self._prompt_tokens, req)

    def _sampling(self, req: GenerationRequest) -> Sampling:
        return sampling_for(req, getattr(self.tokenizer, "n_vocab", None))

    def _admit(self) -> None:
        self._admitted += 1
        self._idle.clear()

    def _release(self) -> None:
        self._admitted -= 1
        if self._admitted == 0:
            self._idle.set()

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self._check_model(req.model)
        sampling = self._sampling(req)
        s = self.settings
        if self._closing:
            raise EngineUnavailableError(SHUTTING_DOWN)
        if self._admitted >= s.parallel + s.max_queue:
            raise ServerBusyError(
                f"All {s.parallel} slots and {s.max_queue} queue places of {s.name} are taken; "
                "retry shortly.", retry_after=1)
        self._admit()
        try:
            prompt, template_stops = await self._tokenize(req)
            constraint = None
            if req.structure is not None:
                # compiling a schema can take a while (and the first one builds the
                # grammar's view of the vocabulary): off the loop
                param = "tools" if req.structure.kind == "tool_calls" else "response_format"
                constraint = await asyncio.get_running_loop().run_in_executor(
                    self._tokenize_pool, compile_constraint, req.structure, self.tokenizer, param)
        except BaseException:
            self._release()
            raise
        n_ctx = self.settings.n_ctx
        if len(prompt) >= n_ctx:
            self._release()
            raise PromptTooLongError(len(prompt), n_ctx)
        if self._closing:   # shutdown began while the prompt was tokenized
            self._release()
            raise EngineUnavailableError(SHUTTING_DOWN)
        budget = n_ctx - len(prompt)
        max_tokens = budget if req.max_tokens is None else min(req.max_tokens, budget)
        rid = req.request_id
        info = RequestInfo(rid, self.settings.name, RequestStatus.QUEUED, len(prompt), 0, 0.0, None, time.time(),
                           strategy=self._decoder.telemetry.strategy)
        ar = ActiveRequest(rid, new_session_id(self._sessions), prompt, sampling, max_tokens,
                           StopMatcher(tuple(req.stop) + tuple(template_stops)), info, constraint=constraint,
                           client=req.client)
        self._active[rid] = ar
        self._update(ar)
        events: asyncio.Queue = asyncio.Queue()
        self._channels[rid] = events
        task: asyncio.Task | None = None
        try:
            yield Admitted(prompt_tokens=len(prompt))
            # The request runs in its own task and hands events over through a queue:
            # decoding never waits for the HTTP client to take the previous token, so every
            # session is ready for the next batch at once (continuous batching stays dense).
            task = asyncio.get_running_loop().create_task(self._produce(events, ar), name=f"request-{rid}")
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Finished):
                    return
        finally:
            try:
                if task is None:    # closed at Admitted: it never ran
                    self._finish(ar, RequestStatus.CANCELLED)
                else:
                    if not task.done():
                        task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            finally:
                self._channels.pop(rid, None)
                self._release()

    async def _produce(self, events: asyncio.Queue, ar: ActiveRequest) -> None:
        """Prefill and decode one request, putting its events on ``events``."""
        try:
            await self._slots.acquire()
        except BaseException:
            self._finish(ar, RequestStatus.CANCELLED)
            raise
        ar.info = replace(ar.info, status=RequestStatus.PREFILL)
        decoder = self._decoder
        try:
            # ---- prefill -----------------------------------------------------------------
            t_prefill = time.perf_counter()
            first = await self._prefill(ar)
            if ar.constraint is not None:
                ar.constraint.commit([first])
            prefill_s = time.perf_counter() - t_prefill
            decoder.telemetry.record_prompt(ar.id, len(ar.prompt), prefill_s)
            ar.first_token_t = time.perf_counter()
            # ---- decode ------------------------------------------------------------------
            await decoder.start(ar, first)
            ar.pos = len(ar.prompt)
            pending = [first]
            t_decode = time.perf_counter()
            self.scheduler.enter(ar.session)
            while True:
                # emit what the last step produced
                for delta in ar.take(pending, self.tokenizer):
                    events.put_nowait(delta)
                self._progress(ar)
                if ar.done:
                    break
                pending = await decoder.step(ar, pending[-1])
                ar.pos += len(pending)  # last + accepted drafts entered the KV
            if tail := ar.tail():
                events.put_nowait(TextDelta(tail, ()))
            decoder.remember(ar)
            decode_s = time.perf_counter() - t_decode
            counters, now = decoder.telemetry.counters(ar.id), decoder.telemetry.snapshot()
            self._finish(ar, RequestStatus.DONE)
            n_prompt, n_gen = len(ar.prompt), len(ar.generated)
            events.put_nowait(Finished(ar.finish, Usage(n_prompt, n_gen), Timings(
                prompt_n=n_prompt, prompt_ms=1e3 * prefill_s, predicted_n=n_gen,
                predicted_ms=1e3 * decode_s, draft_n=counters.proposed,
                draft_n_accepted=counters.accepted, draft_windows=counters.windows,
                draft_verify_ms=1e3 * counters.verify_s, plain_steps=counters.plain_steps,
                draft_lookahead=counters.lookahead, draft_lookahead_used=counters.lookahead_used,
                spec_strategy=now.strategy, spec_state=now.state.value,
                spec_window=now.current_window)))
        except asyncio.CancelledError:
            self._finish(ar, RequestStatus.CANCELLED)
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, typed
            self._finish(ar, RequestStatus.ERROR)
            if error_spec(exc) is None:
                log.exception("request %s failed", ar.id)
                exc = EngineFailedError(f"generation failed: {exc}")
            elif not isinstance(exc, ServeError):
                log.warning("request %s failed: %s: %s", ar.id, type(exc).__name__, exc)
            events.put_nowait(exc)
        finally:
            ar.withdraw_lookahead()
            self.scheduler.leave(ar.session)
            decoder.telemetry.end_request(ar.id)
            try:
                await asyncio.shield(self._end_session(ar.session))
            finally:
                self._slots.release()

    # ---- steps --------------------------------------------------------------------------

    async def _prefill(self, ar: ActiveRequest) -> int:
        nb = self.settings.n_batch
        arr = np.asarray(ar.prompt, dtype=np.int32)
        result = None
        for start in range(0, len(arr), nb):
            chunk = arr[start:start + nb]
            last = start + nb >= len(arr)
            mask = ar.constraint.masks() if last and ar.constraint is not None else None
            result = await self.scheduler.submit(Step(ar.session, start, chunk, 1 if last else 0,
                                                      (), ar.sampling, mask))
        assert result is not None
        return result.tokens[-1]

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
        return (self._decoder.telemetry.snapshot(),)

    def recent_drafts(self):
        return self._decoder.telemetry.recent()

    async def shutdown(self, grace: float) -> int:
        """Node shutdown: refuse new requests (:class:`EngineUnavailableError`, a 503),
        give the admitted ones up to ``grace`` seconds to finish, then end the rest with
        an EngineUnavailableError (:data:`ENDED_AT_SHUTDOWN`) after the text they already
        produced. Returns how many were ended; takes at most ``grace`` + :data:`END_WAIT_S`."""
        self._closing = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace)
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
        self._decoder.close()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)


def sampling_for(req: GenerationRequest, n_vocab: int | None = None) -> Sampling:
    """The final stage's :class:`Sampling` for ``req``; raises InvalidRequestError.

    Every value that comes out samples without error (the final stage runs a whole batch
    at once, so one value that raises there fails every request beside it): seed None or
    -1 is random (llama.cpp's and many clients' spelling), another negative seed is taken
    modulo 2**64; top_k <= 0 or >= the vocabulary is off; top_p <= 0 and temperatures
    below MIN_TEMPERATURE are greedy."""
    t, p = req.temperature, req.top_p
    if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
        raise InvalidRequestError("temperature", f"Invalid value for 'temperature': {t!r} (expected >= 0).")
    if not (isinstance(p, (int, float)) and math.isfinite(p) and p <= 1):
        raise InvalidRequestError("top_p", f"Invalid value for 'top_p': {p!r} (expected 0..1).")
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
    if t < MIN_TEMPERATURE or p <= 0:
        return Sampling(temperature=0.0, top_k=0, top_p=1.0, seed=seed % SEED_SPACE)
    return Sampling(temperature=float(t), top_k=top_k, top_p=float(p), seed=seed % SEED_SPACE)
