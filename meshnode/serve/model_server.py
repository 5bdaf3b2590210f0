"""Stage 0's request loop: one model served to the OpenAI layer (an EngineClient).

Theory of operation
-------------------
``generate`` turns a request into tokens (the GGUF's chat template), admits it, then:

1. **Prefill**: the prompt goes through the pipeline in chunks of ``n_batch`` rows;
   only the last chunk asks for logits, so earlier chunks stream through the stages
   while stage 0 computes the next one.
2. **Decode**: each step sends ``[last]`` (plain) or ``[last, d1..dk]`` (verify) as one
   step to the :class:`~meshnode.serve.scheduler.BatchScheduler`, which batches it with
   the other active sessions. The final stage returns the accepted drafts plus one
   bonus token; rejected rows are dropped by every stage when the next step starts at
   an earlier position.
3. **Speculation** is decided per step by the model's :class:`~meshnode.spec.policy.AutoPolicy`
   (cold observation, enabled, cooling down) and sized by its window controller,
   which learns the route's verify cost. On a split, a lone greedy n-gram stream may
   send the next window before this one returns (a *lookahead*,
   :mod:`meshnode.spec.lookahead`): taken when its guess held, dropped otherwise.
4. Text is produced incrementally (UTF-8 safe), stop strings are honoured by
   :class:`~meshnode.serve.client.StopMatcher`, end-of-generation tokens and
   ``max_tokens`` end the request. The session is freed on every stage in ``finally``,
   which also runs when the HTTP client goes away.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
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
    TextDelta,
    Timings,
    Usage,
)
from meshnode.serve.errors import ContextOverflowError, EngineFailedError, ServeError, UnknownModelError
from meshnode.mesh.final import Sampling
from meshnode.mesh.pipeline import Pipeline, Step
from meshnode.serve.scheduler import BatchScheduler
from meshnode.spec.cost_model import CostModel
from meshnode.spec.lookahead import LookaheadGate
from meshnode.spec.ngram import MIN_NGRAM_MATCH, NGramProposer
from meshnode.spec.policy import AutoPolicy
from meshnode.spec.stats import SpecTelemetry
from meshnode.spec.strategy import Proposer, SpecConfig
from meshnode.spec.window import WindowPolicy, make_window
from meshnode.state import DraftVerified, RequestInfo, RequestUpdated

log = logging.getLogger(__name__)

MAX_DRAFT = 16          # rows per verify stay well inside batch invariance (<= 32)
RECENT_REQUESTS = 50


@dataclass
class ServeSettings:
    name: str
    n_ctx: int = 2048           # per request context
    n_batch: int = 64           # prefill chunk (every stage uses the same schedule)
    max_batch_rows: int = 32
    parallel: int = 4           # sessions at once; later requests wait in a queue
    aliases: tuple[str, ...] = ()
    spec: SpecConfig | None = None


@dataclass
class _Req:
    info: RequestInfo
    t0: float
    first_token_t: float | None = None


@dataclass
class _Spec:
    """One model's speculation machinery, shared by its requests."""

    config: SpecConfig | None
    policy: AutoPolicy
    window: object
    cost: CostModel
    telemetry: SpecTelemetry
    draft: Proposer | None = None
    draft_pool: ThreadPoolExecutor | None = None
    draft_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    gate: LookaheadGate = field(default_factory=LookaheadGate)


@dataclass
class _Sent:
    """A decode step handed to the scheduler, its result not yet taken."""

    step: Step
    result: asyncio.Future
    lookahead: bool = False

    @property
    def pos(self) -> int:
        return self.step.pos

    @property
    def last(self) -> int:
        return int(self.step.tokens[0])

    @property
    def drafts(self) -> tuple[int, ...]:
        return self.step.drafts

    def withdraw(self) -> None:
        """Give the step up: not run if it has not left the scheduler, its result (or
        failure) ignored if it has."""
        if not self.result.done():
            self.result.cancel()
        elif not self.result.cancelled():
            self.result.exception()   # retrieved: asyncio does not log it as lost


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
        self._sessions = itertools.count(1)
        # Every stage holds parallel sequence slots; requests beyond that queue here.
        self._slots = asyncio.Semaphore(settings.parallel)
        self._active: dict[str, _Req] = {}
        self._recent: deque[RequestInfo] = deque(maxlen=RECENT_REQUESTS)
        # Read by the node's telemetry sampler (one point a second).
        self.tokens_out = 0
        self.last_ttft_ms: float | None = None
        self.last_tpot_ms: float | None = None
        self.created = int(time.time())
        cfg = settings.spec
        strategy = "none" if cfg is None or not cfg.enabled else ("draft" if cfg.type == "draft-model" else "ngram")
        mode = "off" if cfg is None or not cfg.enabled else cfg.mode
        if cfg is not None and cfg.type == "draft-model" and draft is None:
            strategy, mode = "none", "off"   # the caller already warned why
        cost = CostModel(hop_s=0.0)
        policy = AutoPolicy(mode, name=strategy, cost=cost, observes=strategy != "draft",
                            on_transition=lambda old, new, why: self._spec.telemetry.set_state(new))
        window = make_window(cfg.window if cfg is not None and cfg.enabled else WindowPolicy(), cost)
        self._spec = _Spec(cfg, policy, window, cost, SpecTelemetry(strategy, state=policy.state),
                           draft, ThreadPoolExecutor(1, thread_name_prefix="draft") if draft else None)

    # ---- EngineClient -------------------------------------------------------------------

    def models(self) -> list[ModelCard]:
        return [ModelCard(id=self.settings.name, created=self.created, n_ctx=self.settings.n_ctx)]

    def _check_model(self, name: str) -> None:
        s = self.settings
        if name.lower() not in {n.lower() for n in (s.name, *s.aliases)}:
            raise UnknownModelError(name)

    def _prompt_tokens(self, req: GenerationRequest) -> tuple[list[int], list[str]]:
        if req.messages is not None:
            msgs = [{"role": m.role, "content": m.content} for m in req.messages]
            return self.tokenizer.apply_chat_template(msgs)
        return self.tokenizer.encode(req.prompt or "", add_bos=True), []

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self._check_model(req.model)
        prompt, template_stops = self._prompt_tokens(req)
        n_ctx = self.settings.n_ctx
        if len(prompt) >= n_ctx:
            raise ContextOverflowError(len(prompt), n_ctx)
        budget = n_ctx - len(prompt)
        max_tokens = budget if req.max_tokens is None else min(req.max_tokens, budget)
        sampling = Sampling(temperature=max(0.0, req.temperature), top_k=req.top_k or 0,
                            top_p=req.top_p, seed=req.seed if req.seed is not None else
                            int.from_bytes(np.random.default_rng().bytes(4), "little"))
        session = next(self._sessions)
        rid = req.request_id
        now = time.time()
        st = _Req(RequestInfo(rid, self.settings.name, "queued", len(prompt), 0, 0.0, None, now,
                              strategy=self._spec.telemetry.strategy), time.perf_counter())
        self._active[rid] = st
        self._update(st)
        yield Admitted(prompt_tokens=len(prompt))
        # The request runs in its own task and hands events over through a queue: decoding
        # never waits for the HTTP client to take the previous token, so every session is
        # ready for the next batch at once (continuous batching stays dense).
        events: asyncio.Queue = asyncio.Queue()
        task = asyncio.get_running_loop().create_task(
            self._produce(events, st, session, prompt, template_stops, req, sampling, max_tokens),
            name=f"request-{rid}")
        try:
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Finished):
                    return
        finally:
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _produce(self, events: asyncio.Queue, st: _Req, session: int, prompt: list[int],
                       template_stops: list[str], req: GenerationRequest, sampling: Sampling,
                       max_tokens: int) -> None:
        """Prefill and decode one request, putting its events on ``events``."""
        rid = req.request_id
        n_ctx = self.settings.n_ctx
        try:
            await self._slots.acquire()
        except BaseException:
            self._finish(st, "cancelled")
            raise
        st.info = replace(st.info, status="prefill")
        finish = "length"
        generated: list[int] = []
        stops = StopMatcher(tuple(req.stop) + tuple(template_stops))
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        spec = self._spec
        ahead: _Sent | None = None   # a lookahead window in flight
        try:
            # ---- prefill -----------------------------------------------------------------
            t_prefill = time.perf_counter()
            first = await self._prefill(session, prompt, sampling)
            prefill_s = time.perf_counter() - t_prefill
            spec.telemetry.record_prompt(rid, len(prompt), prefill_s)
            st.first_token_t = time.perf_counter()
            # ---- decode ------------------------------------------------------------------
            # Both proposers hold the whole context: prompt + every generated token.
            proposer = NGramProposer(prompt)
            proposer.observe([first])
            spec.policy.on_prompt(prompt)
            if spec.draft is not None:
                # prefill the draft now only if it will draft (not while cooling down)
                await self._draft_call(functools.partial(spec.draft.reset, list(prompt),
                                                         sync=spec.policy.should_draft))
                await self._draft_call(spec.draft.accept, [first])
            pos = len(prompt)
            pending = [first]
            spec.gate.window_done(0, 0)   # a new text: no run to continue yet
            t_decode = time.perf_counter()
            self.scheduler.enter(session)
            while True:
                # emit what the last step produced
                done = False
                for tok in pending:
                    generated.append(tok)
                    if tok in self.tokenizer.eog_ids:
                        finish, done = "stop", True
                        break
                    text = stops.feed(utf8.decode(self.tokenizer.decode_bytes([tok])))
                    if text:
                        events.put_nowait(TextDelta(text, (tok,)))
                    if stops.stopped:
                        finish, done = "stop", True
                        break
                    if len(generated) >= max_tokens:
                        finish, done = "length", True
                        break
                self._progress(st, len(generated))
                if done:
                    break
                last = pending[-1]
                pending, ahead = await self._decode_step(rid, session, pos, last, proposer, sampling,
                                                         max_tokens - len(generated), n_ctx, ahead)
                pos += len(pending)  # last + accepted drafts entered the KV
            tail = stops.flush() + utf8.decode(b"", final=True)
            if tail and not stops.stopped:
                events.put_nowait(TextDelta(tail, ()))
            decode_s = time.perf_counter() - t_decode
            counters, now = spec.telemetry.counters(rid), spec.telemetry.snapshot()
            self._finish(st, "done")
            events.put_nowait(Finished(finish, Usage(len(prompt), len(generated)), Timings(
                prompt_n=len(prompt), prompt_ms=1e3 * prefill_s, predicted_n=len(generated),
                predicted_ms=1e3 * decode_s, draft_n=counters.proposed,
                draft_n_accepted=counters.accepted, draft_windows=counters.windows,
                draft_verify_ms=1e3 * counters.verify_s, plain_steps=counters.plain_steps,
                draft_lookahead=counters.lookahead, draft_lookahead_used=counters.lookahead_used,
                spec_strategy=now.strategy, spec_state=now.state.value,
                spec_window=now.current_window)))
        except asyncio.CancelledError:
            self._finish(st, "cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, typed
            self._finish(st, "error")
            if not isinstance(exc, ServeError):
                log.exception("request %s failed", rid)
                exc = EngineFailedError(f"generation failed: {exc}")
            events.put_nowait(exc)
        finally:
            if ahead is not None:
                ahead.withdraw()
            self.scheduler.leave(session)
            spec.telemetry.end_request(rid)
            try:
                await asyncio.shield(self._end_session(session))
            finally:
                self._slots.release()

    # ---- steps --------------------------------------------------------------------------

    async def _prefill(self, session: int, prompt: list[int], sampling: Sampling) -> int:
        nb = self.settings.n_batch
        arr = np.asarray(prompt, dtype=np.int32)
        result = None
        for start in range(0, len(arr), nb):
            chunk = arr[start:start + nb]
            last = start + nb >= len(arr)
            result = await self.scheduler.submit(Step(session, start, chunk, 1 if last else 0,
                                                      (), sampling))
        assert result is not None
        return result.tokens[-1]

    async def _decode_step(self, rid: str, session: int, pos: int, last: int,
                           ngram: NGramProposer, sampling: Sampling, remaining: int,
                           n_ctx: int, ahead: _Sent | None) -> tuple[list[int], _Sent | None]:
        """One decode step of ``last`` at ``pos``: its tokens, and the lookahead window
        sent behind it (if any). ``ahead`` is the lookahead sent during the previous
        step: taken as this step when its guess held, dropped otherwise."""
        spec = self._spec
        t0 = time.perf_counter()
        step = None
        if ahead is not None:
            used = ahead.pos == pos and ahead.last == last   # full acceptance, bonus guessed
            spec.gate.outcome(used)
            spec.telemetry.record_lookahead(rid, used)
            if used:
                step = ahead
            else:
                log.debug("step %s: lookahead at %d dropped", rid, ahead.pos)
                ahead.withdraw()
        if step is None:
            drafts: list[int] = []
            room = min(remaining - 1, n_ctx - pos - 2, MAX_DRAFT)
            if spec.policy.should_draft and room > 0:
                k = min(spec.window.next_window(), room)
                if spec.draft is not None:
                    drafts = await self._draft_call(spec.draft.propose, [], k)
                else:
                    drafts = ngram.propose(k, min_match=MIN_NGRAM_MATCH)
                drafts = [int(t) for t in drafts[:k]]
                spec.telemetry.set_window(k)
            step = self._send(session, pos, last, drafts, sampling)
        nxt = self._look_ahead(session, step, ngram, sampling, remaining, n_ctx)
        try:
            res = await step.result
        except BaseException:
            if nxt is not None:
                nxt.withdraw()   # the caller never sees it
            raise
        dt = time.perf_counter() - t0  # drafting included: it is part of what a step costs
        assert res is not None
        tokens, drafts = list(res.tokens), step.drafts
        if not step.lookahead:
            # a lookahead's wait overlapped the step before it: not what a window costs
            spec.cost.observe(len(drafts), dt)
        spec.gate.window_done(len(drafts), res.n_accepted)   # a plain step ends any run
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %s: %d draft(s), %d accepted, %.1f ms (state %s, window %s%s)", rid,
                      len(drafts), res.n_accepted, 1e3 * dt, spec.policy.state.value,
                      getattr(spec.window, "size", "-"), ", lookahead" if step.lookahead else "")
        if drafts:
            spec.policy.record_verify(len(drafts), res.n_accepted, dt)
            spec.window.update(len(drafts), res.n_accepted)
            spec.telemetry.record_window(rid, drafts, res.n_accepted, tokens[-1], dt)
            self._publish(DraftVerified(
                rid, spec.telemetry.strategy,
                tuple(self.tokenizer.decode([t]) for t in drafts), res.n_accepted,
                self.tokenizer.decode([tokens[-1]]), time.time()))
        else:
            if spec.policy.should_observe:
                spec.policy.record_cold(ngram.would_hit(tokens[0], min_match=MIN_NGRAM_MATCH))
            spec.telemetry.record_plain(rid, dt, len(tokens))
        ngram.observe(tokens)
        if spec.draft is not None:
            await self._draft_call(spec.draft.accept, tokens)
        spec.policy.on_generated(len(tokens))
        return tokens, nxt

    def _send(self, session: int, pos: int, last: int, drafts: list[int], sampling: Sampling,
              *, lookahead: bool = False) -> _Sent:
        step = Step(session, pos, np.asarray([last, *drafts], dtype=np.int32), len(drafts) + 1,
                    tuple(drafts), sampling)
        return _Sent(step, self.scheduler.enqueue(step), lookahead)

    def _look_ahead(self, session: int, step: _Sent, ngram: NGramProposer, sampling: Sampling,
                    remaining: int, n_ctx: int) -> _Sent | None:
        """Send the window that follows ``step`` if it is fully accepted and its bonus is
        the proposer's next token (see :mod:`meshnode.spec.lookahead` for when)."""
        spec = self._spec
        if (not step.drafts or self.pipeline.n_stages < 2 or not sampling.greedy
                or spec.draft is not None or not spec.policy.should_draft
                or self.scheduler.decoding != 1 or not spec.gate.allow()):
            return None
        k = len(step.drafts)
        pos2, remaining2 = step.pos + k + 1, remaining - (k + 1)
        room = min(remaining2 - 1, n_ctx - pos2 - 2, MAX_DRAFT)
        if room < 1:
            return None
        k2 = min(spec.window.next_window(), room)
        # the proposer's context ends at step.last: guess what follows the drafts in flight
        cont = ngram.propose(1 + k2, min_match=MIN_NGRAM_MATCH, after=step.drafts)
        if not cont:
            return None
        return self._send(session, pos2, cont[0], cont[1:], sampling, lookahead=True)

    async def _draft_call(self, fn, *args):
        spec = self._spec
        async with spec.draft_lock:
            return await asyncio.get_running_loop().run_in_executor(spec.draft_pool, fn, *args)

    async def _end_session(self, session: int) -> None:
        try:
            await self.pipeline.end_session(session)
        except Exception:  # noqa: BLE001 - freeing must not mask the real outcome
            log.debug("end_session(%s) failed", session, exc_info=True)

    # ---- telemetry ----------------------------------------------------------------------

    def _update(self, st: _Req) -> None:
        self._publish(RequestUpdated(st.info))

    def _progress(self, st: _Req, n: int) -> None:
        elapsed = time.perf_counter() - (st.first_token_t or st.t0)
        ttft = None if st.first_token_t is None else 1e3 * (st.first_token_t - st.t0)
        tps = (n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0
        self.tokens_out += n - st.info.generated_tokens
        self.last_ttft_ms = ttft if ttft is not None else self.last_ttft_ms
        if tps:
            self.last_tpot_ms = 1e3 / tps
        st.info = replace(st.info, status="decoding", generated_tokens=n, tokens_per_s=tps, ttft_ms=ttft)

    def _finish(self, st: _Req, status: str) -> None:
        if st.info.request_id not in self._active:
            return
        del self._active[st.info.request_id]
        st.info = replace(st.info, status=status, finished_at=time.time())
        self._recent.appendleft(st.info)
        self._update(st)

    def requests(self) -> tuple[RequestInfo, ...]:
        return tuple(r.info for r in self._active.values()) + tuple(self._recent)

    def spec_stats(self):
        return (self._spec.telemetry.snapshot(),)

    def recent_drafts(self):
        return self._spec.telemetry.recent()

    async def close(self) -> None:
        await self.scheduler.close()
        await self.pipeline.close()
        if self._spec.draft_pool is not None:
            self._spec.draft_pool.shutdown(wait=False)
