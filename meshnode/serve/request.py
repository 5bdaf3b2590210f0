"""One request in the model server, from admission to cleanup.

Theory of operation
-------------------
:class:`ActiveRequest` is everything the model server knows about one admitted request:
its session (the id every stage keys its KV by), prompt, sampling, limits and stop
strings; where its KV ends (``pos``) and the tokens generated so far; its telemetry
snapshot; and its speculation state (the n-gram proposer over its context and a
lookahead window in flight, both driven by :mod:`meshnode.serve.speculation`).

It holds no engine and does no I/O. The model server drives its life cycle; the
speculative decoder its decode steps. :meth:`ActiveRequest.take` turns the tokens a step
produced into text (UTF-8 safe, stop strings held back until they can no longer match)
and decides when the request is done.
"""

from __future__ import annotations

import asyncio
import bisect
import codecs
import secrets
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from meshnode.engine.tokenizer import Tokenizer
from meshnode.serve.client import StopMatcher, TextDelta, TokenLogprob, TopLogprob
from meshnode.mesh.final import NO_COUNTS, Counts, Sampling, recent_tokens
from meshnode.mesh.logprobs import TokenLogprobs
from meshnode.mesh.pipeline import Step
from meshnode.spec.suffix import SuffixProposer
from meshnode.state import RequestInfo


def new_session_id(in_use: set[int]) -> int:
    """A random 64-bit session id, never 0 and never one in ``in_use`` (added to it).

    Every stage keys its KV by the session id: sequential ids would let a member of the
    mesh guess another coordinator's sessions."""
    while True:
        session = secrets.randbits(64)
        if session and session not in in_use:
            in_use.add(session)
            return session


@dataclass
class SentStep:
    """A decode step handed to the scheduler, its result not yet taken."""

    step: Step
    result: asyncio.Future
    t0: float                    # perf_counter when its drafting began
    lookahead: bool = False      # sent on a guess (meshnode.spec.lookahead)
    by_model: bool = False       # its drafts came from the draft model
    company: int = 0             # the scheduler's company count when it was sent (ran_alone)

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


PREDICTION_MATCH = 3   # the shortest run of tokens counted as the completion repeating the prediction


def prediction_usage(prediction: Sequence[int], completion: Sequence[int],
                     min_run: int = PREDICTION_MATCH) -> tuple[int, int]:
    """OpenAI's ``accepted_prediction_tokens`` and ``rejected_prediction_tokens``: the
    prediction's tokens the completion repeats, in order, and the rest of them.

    Counted on the texts, not on the drafts, so they mean the same whether or not the
    policy drafted (``timings`` counts drafts). Left to right, each run of at least
    ``min_run`` completion tokens that the prediction holds at or after the end of the
    last run taken is extended as far as both agree and counted: what an edit keeps of
    the file it rewrites. Why not an exact diff (difflib): its time grows with the
    product of the lengths on repetitive texts (220 s for 16,000 tokens of a repeated
    list), and the completion is whatever the model was led to write; this is
    O(len(completion) * log) with an index of the prediction's runs."""
    if not prediction:
        return 0, 0
    k = max(1, min(min_run, len(prediction)))
    starts: dict[tuple[int, ...], list[int]] = {}
    for j in range(len(prediction) - k + 1):
        starts.setdefault(tuple(prediction[j:j + k]), []).append(j)
    accepted = p = i = 0
    while i + k <= len(completion):
        at = starts.get(tuple(completion[i:i + k]))
        n = bisect.bisect_left(at, p) if at else 0
        if not at or n == len(at):
            i += 1
            continue
        j, run = at[n], k
        while i + run < len(completion) and j + run < len(prediction) and completion[i + run] == prediction[j + run]:
            run += 1
        accepted += run
        i, p = i + run, j + run
    return accepted, len(prediction) - accepted


def _utf8_decoder() -> codecs.IncrementalDecoder:
    # a token may end inside a multi-byte character: its bytes wait for the next token's
    return codecs.getincrementaldecoder("utf-8")("replace")


@dataclass(eq=False)
class ActiveRequest:
    """One admitted request. See the module docstring."""

    id: str
    session: int
    prompt: list[int]
    sampling: Sampling
    max_tokens: int              # the request's limit, capped by the context left
    stops: StopMatcher
    info: RequestInfo            # the snapshot published to the UI (replaced, never mutated)
    t0: float = field(default_factory=time.perf_counter)
    first_token_t: float | None = None
    pos: int = 0                 # the session's KV holds positions [0, pos)
    epoch: int = 0               # ... on this route (RouteGate.epoch; failover replays it)
    cached: int = 0              # prompt positions copied from a retained session (prefix reuse)
    generated: list[int] = field(default_factory=list)
    finish: str = "length"       # OpenAI's finish_reason once done
    done: bool = False
    # speculation state, driven by meshnode.serve.speculation
    ngram: SuffixProposer | None = None  # the whole context: prompt + every generated token
    ahead: SentStep | None = None        # the next step, sent already (a lookahead or the next one)
    # grammar-constrained sampling (meshnode.serve.structured.Constraint), or None
    constraint: Any = None
    index: int = 0                       # the choice this is (requests with n > 1)
    last_logprobs: TokenLogprobs | None = None   # the last step's, when asked for
    _lp_pending: list[TokenLogprob] = field(default_factory=list, repr=False)  # text held back
    client: str = ""             # whose recent texts it drafts from (meshnode.spec.suffix)
    prediction: list[int] = field(default_factory=list)   # the predicted output's tokens (drafts only)
    _utf8: codecs.IncrementalDecoder = field(default_factory=_utf8_decoder, repr=False)
    # generated[:_tallied], counted (seen_before: a penalized request's steps)
    _tally: Counter[int] = field(default_factory=Counter, repr=False)
    _tallied: int = 0
    # the context's distinct ids so far, generated[:_distinct_gen] included (a repetition
    # penalty over the whole context)
    _distinct: set[int] | None = field(default=None, repr=False)
    _distinct_gen: int = 0
    # OpenAI's echo: the prompt's text, which the answer starts with (None: no echo); with
    # logprobs, the prefill's chunks score the prompt's tokens (one TokenLogprobs a chunk)
    echo: str | None = None
    scores: list[TokenLogprobs] = field(default_factory=list, repr=False)

    @property
    def scoring(self) -> bool:
        """Whether the prefill scores the prompt's tokens (echo with logprobs)."""
        return self.echo is not None and self.sampling.top_logprobs is not None

    def echo_delta(self, tokenizer: Tokenizer) -> TextDelta:
        """The prompt as the answer's first delta; with logprobs an entry per prompt token
        (the first has no logprob: nothing precedes it)."""
        entries: list[TokenLogprob] = []
        if self.scoring:
            raws = [tokenizer.decode_bytes([t]) for t in self.prompt]
            entries.append(TokenLogprob(*_piece(tokenizer, raws[0]), None, id=self.prompt[0]))
            i = 1
            for lp in self.scores:
                entries += [_entry(tokenizer, self.prompt[i + j], raws[i + j], lp, j) for j in range(len(lp.logprobs))]
                i += len(lp.logprobs)
            if len(entries) != len(self.prompt):
                raise ValueError(f"{len(entries)} scored prompt tokens of {len(self.prompt)}")
        return TextDelta(self.echo or "", tuple(self.prompt), self.index, tuple(entries))

    def seen_before(self, pos: int, pending: Sequence[int] = ()) -> Counts:
        """The generated tokens a step of ``last`` at ``pos`` is penalized by: those at
        positions up to ``pos``, ``last`` included (``pending``: tokens generated after
        ``generated``, not taken yet), and with a repetition penalty the context's recent
        tokens there. Counted once as they come, so a step costs the distinct tokens, not
        the answer's length."""
        s = self.sampling
        if not s.penalized:
            return NO_COUNTS
        n = pos - len(self.prompt) + 1
        if not 0 <= n <= len(self.generated) + len(pending):
            raise ValueError(f"a step at {pos} after {len(self.generated) + len(pending)} generated tokens")
        recent = self._recent(pos + 1, pending) if s.repeats else ()
        if not (s.presence or s.frequency):
            return Counts(recent=recent)
        self._tally.update(self.generated[self._tallied:n])
        self._tallied = max(self._tallied, min(n, len(self.generated)))
        if n == self._tallied:
            return Counts.of(self._tally, recent)
        if n > self._tallied:   # and pending tokens
            return Counts.of(self._tally + Counter(pending[:n - self._tallied]), recent)
        return Counts.of(Counter(self.generated[:n]), recent)   # a step behind the count (none the decoder sends)

    def _recent(self, upto: int, pending: Sequence[int]) -> tuple[int, ...]:
        """:attr:`Counts.recent` for the context's positions [0, upto): the prompt, then
        ``generated``, then ``pending``. The whole context's distinct ids are kept as they
        come (a step costs them, not the context's length)."""
        last_n = self.sampling.repeat_last_n
        if last_n > 0:
            return recent_tokens(self._context(max(0, upto - last_n), upto, pending), last_n)
        P = len(self.prompt)
        if self._distinct is None or upto - P < self._distinct_gen:   # (a step behind: start again)
            self._distinct, self._distinct_gen = set(self.prompt[:upto]), 0
        self._distinct.update(self._context(P + self._distinct_gen, upto, pending))
        self._distinct_gen = max(0, upto - P)
        return tuple(sorted(self._distinct))

    def _context(self, a: int, b: int, pending: Sequence[int]) -> list[int]:
        """The context's tokens at positions [a, b)."""
        P, G = len(self.prompt), len(self.generated)
        out = list(self.prompt[a:min(b, P)])
        if b > P:
            lo, hi = max(a, P) - P, b - P
            out += self.generated[lo:min(hi, G)]
            if hi > G:
                out += list(pending[max(lo, G) - G:hi - G])
        return out

    @property
    def remaining(self) -> int:
        """Tokens the request may still generate."""
        return self.max_tokens - len(self.generated)

    def take(self, tokens: Sequence[int], tokenizer: Tokenizer,
             logprobs: TokenLogprobs | None = None) -> list[TextDelta]:
        """Add the tokens a step produced; return the text they release. Sets ``done``
        (and ``finish``) at an end-of-generation token, a completed stop string or
        ``max_tokens``; the tokens after that one are not taken. ``logprobs`` (the
        step's, one per token) ride on the delta that releases each token's text."""
        deltas: list[TextDelta] = []
        if self.remaining <= 0:   # max_tokens 0 (echo only): the prefill's token is not taken
            self.finish, self.done = "length", True
            return deltas
        for i, tok in enumerate(tokens):
            self.generated.append(tok)
            if tok in tokenizer.eog_ids:
                self.finish, self.done = "stop", True
                break
            raw = tokenizer.decode_bytes([tok])
            if logprobs is not None:
                self._lp_pending.append(_entry(tokenizer, tok, raw, logprobs, i))
            text = self.stops.feed(self._utf8.decode(raw))
            if text:
                deltas.append(TextDelta(text, (tok,), self.index, self._take_logprobs()))
            if self.stops.stopped:
                self.finish, self.done = "stop", True
                break
            if len(self.generated) >= self.max_tokens:
                self.finish, self.done = "length", True
                break
        return deltas

    def tail(self) -> str:
        """The text still held back when generation ends (none after a stop string)."""
        tail = self.stops.flush() + self._utf8.decode(b"", final=True)
        return "" if self.stops.stopped else tail

    def tail_delta(self) -> TextDelta | None:
        """:meth:`tail` as the choice's last delta, with the logprobs of its tokens."""
        text = self.tail()
        lps = () if self.stops.stopped else self._take_logprobs()
        return TextDelta(text, (), self.index, lps) if text or lps else None

    def _take_logprobs(self) -> tuple[TokenLogprob, ...]:
        out = tuple(self._lp_pending)
        self._lp_pending.clear()
        return out

    def withdraw_lookahead(self) -> None:
        """The request ends: a step sent ahead (a lookahead, the next step) is given up."""
        if self.ahead is not None:
            self.ahead.withdraw()


# OpenAI's value for a token the model rules out (JSON has no -Infinity)
MIN_LOGPROB = -9999.0


def _piece(tokenizer: Tokenizer, raw: bytes) -> tuple[str, tuple[int, ...]]:
    return raw.decode("utf-8", "replace"), tuple(raw)


def _entry(tokenizer: Tokenizer, token: int, raw: bytes, lp: TokenLogprobs, i: int) -> TokenLogprob:
    text, b = _piece(tokenizer, raw)
    top = tuple(TopLogprob(*_piece(tokenizer, tokenizer.decode_bytes([t])), max(v, MIN_LOGPROB), id=t)
                for t, v in lp.top(i))
    return TokenLogprob(text, b, max(lp.logprobs[i], MIN_LOGPROB), top, id=token)
