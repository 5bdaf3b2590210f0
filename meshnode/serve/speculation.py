"""Driving speculation: the decode steps of a request, plain or with drafts.

Theory of operation
-------------------
One :class:`SpeculativeDecoder` per served model holds the machinery its requests share:
the :class:`~meshnode.spec.policy.AutoPolicy` (cold observation, enabled, cooling down),
the window controller and the cost model it learns the route's verify cost in, the
draft-model proposer (if any, on the process's compute thread: engine/worker.py), the
lookahead gate and the telemetry.
The model server calls :meth:`~SpeculativeDecoder.start` once a request's prefill is
done and :meth:`~SpeculativeDecoder.step` for every decode step after that; the request's
own state (position, n-gram proposer, the lookahead in flight) lives on its
:class:`~meshnode.serve.request.ActiveRequest`.

A step sends ``[last]`` (plain) or ``[last, d1..dk]`` (a verify window; drafts from the
n-gram proposer, else from the draft model if there is one; ``k`` from the window
controller, capped by the tokens and context left and, on a GPU route, by the KV bucket
rule of :func:`meshnode.spec.window.drafts_at`) to the scheduler. N-gram drafts come from the request's own
text and the same client's recent requests (:mod:`meshnode.spec.suffix`; each finished
request is remembered by :meth:`SpeculativeDecoder.remember`). The final stage returns the accepted drafts
plus one bonus token; rejected rows are dropped by every stage when the next step starts
at an earlier position. Every outcome feeds the policy, the window, the cost model, the
gate and the telemetry. On a split, a lone greedy n-gram stream may send the next window
before this one returns (a *lookahead*, :mod:`meshnode.spec.lookahead`): taken as the
next step when its guess held (full acceptance, bonus guessed), dropped otherwise.
When a step returns, the next one is sent before the model server turns its tokens into
text (:meth:`SpeculativeDecoder._send_ahead`, docs/speculative.md "The next step goes
first"), so on a split that work overlaps the next step's trip through the stages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from meshnode.engine.tokenizer import Tokenizer
from meshnode.engine.worker import run_compute
from meshnode.mesh.pipeline import Step
from meshnode.serve.errors import EngineFailedError
from meshnode.serve.request import ActiveRequest, SentStep
from meshnode.serve.scheduler import BatchScheduler
from meshnode.spec.catchup import CatchUpPace
from meshnode.spec.cost_model import CostModel
from meshnode.spec.draft import UNIFORM_CATCHUP_ROWS
from meshnode.spec.lookahead import LookaheadGate
from meshnode.spec.ngram import min_match_for
from meshnode.spec.suffix import RecentTexts, SuffixAutomaton, SuffixProposer
from meshnode.spec.policy import AutoPolicy
from meshnode.spec.stats import SpecTelemetry
from meshnode.spec.strategy import DraftProposer, RouteWindows, SpecConfig
from meshnode.spec.window import StageCompute, WindowController, WindowPolicy, make_window
from meshnode.state import DraftVerified, SpecStats

log = logging.getLogger(__name__)

MAX_DRAFT = 16          # rows per verify stay well inside batch invariance (<= 32)
# A token whose logit_bias is at most this is all but never sampled (its odds times
# e^-30): drafts stop before it rather than spend verify rows on a sure rejection.
BANNED_BIAS = -30.0


@functools.lru_cache(maxsize=64)
def _banned(bias_ids: tuple[int, ...], bias_values: tuple[float, ...]) -> frozenset[int]:
    return frozenset(t for t, v in zip(bias_ids, bias_values) if v <= BANNED_BIAS)


def until_banned(drafts: Sequence[int], sampling) -> list[int]:
    """``drafts`` up to the first token the request's logit_bias bans (mesh.final.Sampling)."""
    drafts = list(drafts)
    if not sampling.bias_ids:
        return drafts
    banned = _banned(sampling.bias_ids, sampling.bias_values)
    return next((drafts[:i] for i, t in enumerate(drafts) if t in banned), drafts)


class SpeculativeDecoder:
    """One model's speculation machinery, shared by its requests, and the decode steps
    that drive it. See the module docstring."""

    def __init__(self, config: SpecConfig | None, draft: DraftProposer | None, *,
                 scheduler: BatchScheduler, tokenizer: Tokenizer, n_ctx: int,
                 publish: Callable[[object], None]) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self._publish = publish
        strategy = "none" if config is None or not config.enabled else (
            "draft" if config.type == "draft-model" else "ngram")
        mode = "off" if config is None or not config.enabled else config.mode
        if config is not None and config.type == "draft-model" and draft is None:
            strategy, mode = "none", "off"   # the caller already warned why
        self.config = config
        self._route = RouteWindows(config)   # the windows the current route computes exactly
        self.cost = CostModel(hop_s=0.0)
        self.policy = AutoPolicy(mode, name=strategy, cost=self.cost, observes=strategy != "draft",
                                 on_transition=lambda old, new, why: self.telemetry.set_state(new))
        self.window: WindowController = make_window(
            config.window if config is not None and config.enabled else WindowPolicy(), self.cost)
        self.telemetry = SpecTelemetry(strategy, state=self.policy.state)
        self.draft = draft
        self.draft_lock = asyncio.Lock()
        # The draft model holds one context: it follows one request at a time (the first
        # to start while it is free); requests beside it draft by n-gram alone.
        self._draft_for: ActiveRequest | None = None
        self._catching_up: asyncio.Future | None = None   # its catch-up in the background
        self._pace = CatchUpPace(pinned=mode == "on")     # ... in pieces (spec/catchup.py)
        self._told_left_behind = False                     # (its one INFO line: _catch_up_pays)
        self.gate = LookaheadGate()
        # the same client's recent texts, drafted from (only where n-gram drafting runs)
        self.recent = RecentTexts() if strategy == "ngram" else None
        self._remembering: set[asyncio.Future] = set()
        # the last predicted output's automaton, by the token list the choices of one
        # request share (``n`` > 1): built once, not once per choice
        self._predicted: tuple[list[int], asyncio.Future[SuffixAutomaton]] | None = None

    @property
    def min_match(self) -> int:
        """The shortest suffix match an n-gram draft continues now: shorter where this
        route's verify windows cost next to a plain step (spec/ngram.py, min_match_for)."""
        return min_match_for(self.cost.window_steps)

    def follow_route(self, stages: Sequence[StageCompute]) -> None:
        """The model now runs on ``stages``: verify windows at most as wide as all of
        them compute exactly (spec/strategy.py, ``RouteWindows``). The controller starts
        afresh only when its bounds change."""
        if not self._route.follow(stages):
            return
        old, self.config = self.config, self._route.config
        self.window = make_window(self.config.window, self.cost)
        if old is not None and self.config.window.max < old.window.max:
            log.info("speculation: windows of at most %d drafts (a GPU stage: wider windows are not exact there)",
                     self.config.window.max)

    def exact_rows_at(self, pos: int) -> int:
        """The widest step at ``pos`` the current route computes as one-row steps
        (RouteWindows.exact_rows_at: a failover's replay chunks)."""
        return self._route.exact_rows_at(pos)

    def _prediction_automaton(self, prediction: list[int]) -> asyncio.Future[SuffixAutomaton]:
        """The automaton of ``prediction``, built off the loop; the choices of one request
        (one token list) share it."""
        if self._predicted is None or self._predicted[0] is not prediction:
            built = asyncio.get_running_loop().run_in_executor(None, SuffixAutomaton, prediction)
            self._predicted = (prediction, built)
        return self._predicted[1]

    async def start(self, req: ActiveRequest, first: int) -> None:
        """The request's prefill gave ``first``: the proposers take its context."""
        # Only greedy requests draft from other requests' texts: a sampled request's random
        # draws depend on its drafts, so a seeded request must see the same drafts every
        # time (its own context only) to be reproducible.
        if req.prediction:
            # the client's own guess at the answer (OpenAI's predicted output) is the text
            # to draft from, before its recent requests; part of the request, so a seeded
            # request still sees the same drafts every time
            history = await self._prediction_automaton(req.prediction)
        else:
            history = None if self.recent is None or not req.sampling.greedy else \
                self.recent.automaton(req.client, time.monotonic())
        req.ngram = SuffixProposer(req.prompt, history)
        req.ngram.observe([first])
        self.policy.on_prompt(req.prompt, predicted=bool(req.prediction))
        if self.draft is not None and self._draft_for is None and self._catch_up_pays(req, len(req.prompt) + 1):
            self._draft_for = req
            await self._draft_call(functools.partial(self.draft.reset, list(req.prompt), sync=False))
            await self._draft_call(self.draft.accept, [first])
            # prefill the draft now only if it will draft (not while cooling down), and on
            # a split not even then: it catches up while steps are away (_catch_up_meanwhile)
            if self.policy.should_draft and not self._split:
                await self._timed_sync(self.draft)
        self.gate.window_done(0, 0)   # a new text: no run to continue yet

    def _catch_up_pays(self, req: ActiveRequest, lag: int) -> bool:
        """Whether the draft model may catch up on ``lag`` tokens of ``req``'s context
        (spec/catchup.py)."""
        why = self._pace.refusal(lag, req.remaining, split=self._split, plain_s=self.cost.plain_s)
        if why is None:
            return True
        # a user who set up a draft model learns once why it does not draft (then at debug)
        (log.debug if self._told_left_behind else log.info)(
            "%s: the draft model would not catch up in time (%s): n-gram drafts only%s", req.id, why,
            "" if self._told_left_behind else " (so for every such request; logged once)")
        self._told_left_behind = True
        return False

    async def _timed_sync(self, draft: DraftProposer, max_rows: int | None = None) -> None:
        """``draft.sync(max_rows)`` on the compute thread, timed for the pace."""
        def run() -> tuple[int, float]:
            before, t0 = draft.lag, time.perf_counter()
            draft.sync(max_rows)
            return before - draft.lag, time.perf_counter() - t0

        self._pace.caught_up(*await self._draft_call(run))

    def end(self, req: ActiveRequest) -> None:
        """``req`` is over (done, failed or cancelled): the draft model is free for the
        next request."""
        if self._draft_for is req:
            self._draft_for = None

    def _draft_of(self, req: ActiveRequest) -> DraftProposer | None:
        """The draft model when it follows ``req``."""
        return self.draft if self._draft_for is req else None

    @property
    def _split(self) -> bool:
        return self.scheduler.pipeline.n_stages > 1

    async def _catch_up_meanwhile(self, req: ActiveRequest) -> asyncio.Future | None:
        """On a split, a draft model further behind ``req``'s context than a window's
        catch-up (the prompt, a long run of n-gram drafts) catches up a piece of it now,
        in the background, while the step just sent is away at the other stages (the
        draft's calls take turns: ``draft_lock``), so that a later window finds it ready
        instead of catching up before it is sent. The piece (returned: its step's
        result tells the pace whether it fit) is sized to fit that time; none is started
        when at that pace the draft would not catch up before the answer's end
        (spec/catchup.py)."""
        draft = self._draft_of(req)
        if (draft is None or not self._split or self._catching_up is not None
                or not self.policy.should_draft or draft.lag <= UNIFORM_CATCHUP_ROWS):
            return None
        if not self._catch_up_pays(req, draft.lag):
            self._draft_for = None   # (free for the next request)
            return None
        await asyncio.sleep(0)   # the scheduler hands the step to stage 0 first
        piece = self._catching_up = asyncio.ensure_future(self._timed_sync(draft, self._pace.piece_rows))
        piece.add_done_callback(self._caught_up)
        return piece

    def _caught_up(self, fut: asyncio.Future) -> None:
        self._catching_up = None
        if not fut.cancelled():
            fut.exception()   # (logged by _draft_call; its next call fails the request)

    async def step(self, req: ActiveRequest, last: int) -> list[int]:
        """One decode step of ``last`` at ``req.pos``: the tokens it produced (the
        accepted drafts and the bonus token). ``req.ahead``, the step already sent for
        this position (see :meth:`_send_ahead`), is taken as this step; afterwards it is
        the step sent for the next one, if any."""
        ngram, ahead = req.ngram, req.ahead
        assert ngram is not None, "start() first"
        req.ahead = None
        if ahead is not None and ahead.pos == req.pos and ahead.last == last:
            step = ahead
        else:
            if ahead is not None:   # (sent for another position: never taken)
                ahead.withdraw()
            step = await self._next_step(req, req.pos, last)
        nxt = self._look_ahead(req, step, ngram)
        piece = await self._catch_up_meanwhile(req)
        try:
            res = await step.result
        except BaseException:
            if nxt is not None:
                nxt.withdraw()   # the caller never sees it
            raise
        if piece is not None:
            self._pace.piece_ended(overran=not piece.done())
        dt = time.perf_counter() - step.t0  # drafting included: it is part of what a step costs
        assert res is not None
        tokens, drafts = list(res.tokens), step.drafts
        if req.constraint is not None:
            req.constraint.commit(tokens)
        # what a step of this shape costs, from the steps that had the route to themselves:
        # a lookahead's wait overlapped the step before it, and a step beside other
        # requests' steps measured the load
        alone = self.scheduler.ran_alone(step.company)
        if alone and not step.lookahead:
            self.cost.observe(len(drafts), dt)
        self.gate.window_done(len(drafts), res.n_accepted)   # a plain step ends any run
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %s: %d draft(s)%s, %d accepted, %.1f ms (state %s, window %s%s)", req.id,
                      len(drafts), " by the draft model" if step.by_model else "", res.n_accepted, 1e3 * dt,
                      self.policy.state.value, self.window.size, ", lookahead" if step.lookahead else "")
        if drafts:
            self.policy.record_verify(len(drafts), res.n_accepted, dt if alone else None)
            self.window.update(len(drafts), res.n_accepted)
        else:
            if self.policy.should_observe:
                self.policy.record_cold(ngram.would_hit(tokens[0], min_match=self.min_match))
        ngram.observe(tokens)
        if (draft := self._draft_of(req)) is not None:
            await self._draft_call(draft.accept, tokens)
        self.policy.on_generated(len(tokens))
        req.last_logprobs = res.logprobs
        await self._send_ahead(req, step.pos + len(tokens), tokens, nxt)
        # what only the telemetry and the UI need, while the next step runs
        if drafts:
            self.telemetry.record_window(req.id, drafts, res.n_accepted, tokens[-1], dt, step.by_model)
            self._publish(DraftVerified(
                req.id, self.telemetry.strategy,
                tuple(self.tokenizer.decode([t]) for t in drafts), res.n_accepted,
                self.tokenizer.decode([tokens[-1]]), time.time()))
        else:
            self.telemetry.record_plain(req.id, dt, len(tokens))
        return tokens

    async def _send_ahead(self, req: ActiveRequest, pos: int, tokens: list[int], guess: SentStep | None) -> None:
        """Leave in ``req.ahead`` the step for position ``pos``, sent now, before the model
        server turns ``tokens`` into text: on a split that work then overlaps the next
        step's trip through the stages instead of delaying it. ``guess`` (a lookahead sent
        behind this step) is that step when it guessed right.

        Nothing is sent when the request may end here (an end-of-generation token, its
        last token; a stop string can still end it, and the model server then withdraws
        the step) or when the next step needs more than this (the proposal of a draft
        model that drafts now, a grammar's masks)."""
        if req.remaining <= len(tokens) or not self.tokenizer.eog_ids.isdisjoint(tokens):
            if guess is not None:
                guess.withdraw()   # the request ends
            return
        if guess is not None:
            used = guess.pos == pos and guess.last == tokens[-1]   # full acceptance, bonus guessed
            self.gate.outcome(used)
            self.telemetry.record_lookahead(req.id, used)
            if used:
                req.ahead = guess
                return
            log.debug("step %s: lookahead at %d dropped", req.id, guess.pos)
            guess.withdraw()
        if (self._draft_of(req) is not None and self.policy.should_draft) or req.constraint is not None:
            return   # (a draft model not drafting, cooling down, leaves plain steps: sent ahead)
        req.ahead = await self._next_step(req, pos, tokens[-1], tokens)
        await asyncio.sleep(0)   # the scheduler starts it before the caller goes on

    async def _next_step(self, req: ActiveRequest, pos: int, last: int, pending: Sequence[int] = ()) -> SentStep:
        """Send the step of ``last`` at ``pos``: a verify window when the policy drafts
        and the proposer has drafts, else a plain step. ``pending``: the tokens generated
        since ``req.generated`` was last extended (``last`` among them)."""
        t0 = time.perf_counter()
        drafts: list[int] = []
        by_model = False
        room = min(req.remaining - (pos - req.pos) - 1, self.n_ctx - pos - 2, MAX_DRAFT,
                   self._route.drafts_at(pos))
        if self.policy.should_draft and room > 0:
            k = min(self.window.next_window(), room)
            assert req.ngram is not None
            # The text's own repeats first: free, and as often right as a draft model's
            # guesses where they match; the draft model only where they do not (it
            # catches up on the tokens it skipped at its next call).
            drafts = req.ngram.propose(k, min_match=self.min_match)
            draft = self._draft_of(req) if not drafts else None
            if draft is not None and draft.lag > UNIFORM_CATCHUP_ROWS:
                # a prompt, or the tokens of a cooldown, to catch up on: once per request
                # or probe, not what a window costs (the window's time feeds the cost
                # model and the policy's judgement). On a split this step goes without
                # the draft's help and the draft catches up while it is away.
                if self._split:
                    draft = None
                elif not self._catch_up_pays(req, draft.lag):
                    self._draft_for, draft = None, None   # (n-gram drafts only: free for the next request)
                else:
                    await self._timed_sync(draft)
                    t0 = time.perf_counter()
            if draft is not None:
                drafts = await self._draft_call(draft.propose, [], k)
            drafts = until_banned([int(t) for t in drafts[:k]], req.sampling)
            by_model = draft is not None and bool(drafts)
            self.telemetry.set_window(k)
        return self._send(req, pos, last, drafts, t0=t0, by_model=by_model, pending=pending)

    def stats(self) -> SpecStats:
        """The model's speculation counters, with what sizes its windows: the learned
        step cost per window and the acceptance estimate."""
        return dataclasses.replace(
            self.telemetry.snapshot(),
            step_ms=tuple((k, round(1e3 * s, 3)) for k, s in sorted(self.cost.observed.items())),
            acceptance_estimate=round(self.window.acceptance, 4))

    def remember(self, req: ActiveRequest) -> None:
        """A request finished: its text (prompt + generated) becomes draftable for the
        same client's next requests. The automaton is rebuilt on a worker thread."""
        if self.recent is None or not req.client:
            return
        text = [*req.prompt, *req.generated]
        fut = asyncio.get_running_loop().run_in_executor(
            None, self.recent.add, req.client, text, time.monotonic())
        self._remembering.add(fut)
        fut.add_done_callback(self._remembering.discard)

    def _send(self, req: ActiveRequest, pos: int, last: int, drafts: list[int], *,
              lookahead: bool = False, t0: float | None = None, by_model: bool = False,
              pending: Sequence[int] = ()) -> SentStep:
        mask = req.constraint.masks(drafts) if req.constraint is not None else None
        step = Step(req.session, pos, np.asarray([last, *drafts], dtype=np.int32), len(drafts) + 1,
                    tuple(drafts), req.sampling, mask, req.seen_before(pos, pending))
        company = self.scheduler.company
        return SentStep(step, self.scheduler.enqueue(step, req.epoch),
                        time.perf_counter() if t0 is None else t0, lookahead, by_model, company)

    def _look_ahead(self, req: ActiveRequest, step: SentStep, ngram: SuffixProposer) -> SentStep | None:
        """Send the window that follows ``step`` if it is fully accepted and its bonus is
        the proposer's next token (see :mod:`meshnode.spec.lookahead` for when)."""
        # (a constrained request's masks, and a penalized one's counts, follow its
        # committed tokens: no guessing ahead)
        if (not step.drafts or not self._split or not req.sampling.greedy
                or req.constraint is not None or req.sampling.penalized
                or self.draft is not None or not self.policy.should_draft
                or self.scheduler.decoding != 1 or not self.gate.allow()):
            return None
        k = len(step.drafts)
        pos2, remaining2 = step.pos + k + 1, req.remaining - (k + 1)
        room = min(remaining2 - 1, self.n_ctx - pos2 - 2, MAX_DRAFT, self._route.drafts_at(pos2))
        if room < 1:
            return None
        k2 = min(self.window.next_window(), room)
        # the proposer's context ends at step.last: guess what follows the drafts in flight
        cont = until_banned(ngram.propose(1 + k2, min_match=self.min_match, after=step.drafts), req.sampling)
        if not cont:
            return None
        return self._send(req, pos2, cont[0], cont[1:], lookahead=True)

    async def _draft_call(self, fn, *args):
        async with self.draft_lock:
            try:
                # the process's compute thread, where the target's engine runs too
                # (engine/worker.py: one OpenMP team per process)
                return await run_compute(fn, *args)
            except Exception as exc:
                # The draft model only helps: its failures (its own context overflowing
                # included) are not the request's fault, whatever their type.
                log.exception("the draft model failed")
                raise EngineFailedError(f"generation failed: {exc}") from exc

    async def close(self) -> None:
        """Free the draft model's engine (on the compute thread, after a call in flight)."""
        if self.draft is not None:
            async with self.draft_lock:
                await run_compute(self.draft.close)
