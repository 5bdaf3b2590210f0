"""What the final stage does with its logits: sample, or verify a draft window.

One function for every topology: a single node runs it right after its whole-model
forward, a split runs it on the last stage, which then returns the tokens straight to
stage 0. Random state lives here, per session, seeded by the request's seed, so a split
samples exactly what a single node would.

It is part of the mesh's data plane: the stage host of a final stage
(:mod:`meshnode.mesh.stage_host`) and the pipelines at stage 0
(:mod:`meshnode.mesh.pipeline`) both run it.

A step may carry allowed-token masks, one per logit row (grammar-constrained sampling;
stage 0 computes them, :mod:`meshnode.serve.structured`): the logits outside a row's
mask are set to -inf before sampling or verifying, so a forbidden draft is rejected like
any other mismatch and the bonus token is always allowed. Before the masks come the
request's logit bias, its repetition penalty and its presence and frequency penalties; a
step carries the tokens they are applied by (:class:`Counts`: the counts of the tokens
generated before it, the context's recent tokens), so the final stage keeps no history
of a session and a route that replaces a lost one needs none.

A prefill chunk may ask for its prompt tokens' logprobs (OpenAI's ``echo``): its first
logit rows are then *scored* against the prompt tokens that follow them (the model's own
rows, as sampled tokens' logprobs are), and only the rows after those are sampled.

Sampling is per session, so its failures are too: a session whose logits or sampling
parameters make it raise (NaN logits, a value the sampler cannot take) fails alone, and
the other sessions of the same engine call keep their tokens (:meth:`FinalSampler.finalize_isolated`,
used by both callers). Only a failure of the engine call itself fails the whole batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshnode.mesh.logprobs import TokenLogprobs, token_logprobs
from meshnode.spec.acceptance import verify_logits

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    # None: no logprobs; 0..20: the sampled tokens' logprobs and this many alternatives
    top_logprobs: int | None = None
    # OpenAI's logit_bias: added to these tokens' logits before sampling or verifying
    # (ids unique and ascending, values in -100..100; meshnode.serve.model_server.sampling_for)
    bias_ids: tuple[int, ...] = ()
    bias_values: tuple[float, ...] = ()
    # OpenAI's presence_penalty / frequency_penalty (-2..2): subtracted from the logit of
    # every token the answer already holds, once / once per occurrence (Counts)
    presence: float = 0.0
    frequency: float = 0.0
    # llama.cpp's min_p: tokens less probable than min_p times the most probable one are
    # not sampled (0: off)
    min_p: float = 0.0
    # llama.cpp's repeat_penalty / vLLM's repetition_penalty (1: off): the logit of every
    # token among the context's last repeat_last_n tokens (-1: the whole context, prompt
    # included; 0: off) is divided by it when positive, multiplied when not
    repeat: float = 1.0
    repeat_last_n: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def repeats(self) -> bool:
        """Whether the repetition penalty is on (a step then carries the recent tokens)."""
        return self.repeat != 1.0 and self.repeat_last_n != 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence or self.frequency) or self.repeats


# The fields a step carries to the final stage for its sampling: the wire's Segment has
# fields of the same names (meshnode.wire.messages.Segment); top_logprobs rides in its flags.
SEGMENT_FIELDS = ("temperature", "top_k", "top_p", "seed", "min_p", "bias_ids", "bias_values",
                  "presence", "frequency", "repeat", "repeat_last_n")


def segment_fields(s: Sampling) -> dict[str, Any]:
    """``s`` as the Segment fields of :data:`SEGMENT_FIELDS`."""
    return {name: getattr(s, name) for name in SEGMENT_FIELDS}


def sampling_of(segment: Any, top_logprobs: int | None) -> Sampling:
    """The :class:`Sampling` a received segment asks for (the inverse of :func:`segment_fields`)."""
    return Sampling(top_logprobs=top_logprobs, **{name: getattr(segment, name) for name in SEGMENT_FIELDS})


@dataclass(frozen=True, slots=True)
class Counts:
    """The tokens generated before a step's first logit row, with how often each came
    (ids unique and ascending): what presence and frequency penalties are applied by.
    A step carries them, so the final stage keeps no history (a new route after a
    failover needs none)."""

    ids: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()
    # the repetition penalty's tokens before the first row: the context's last
    # repeat_last_n tokens in order (with repeat_last_n -1: the context's distinct ids)
    recent: tuple[int, ...] = ()

    @staticmethod
    def of(tally: dict[int, int], recent: tuple[int, ...] = ()) -> Counts:
        ids = tuple(sorted(tally))
        return Counts(ids, tuple(tally[i] for i in ids), recent)


def recent_tokens(context: Sequence[int], last_n: int) -> tuple[int, ...]:
    """:attr:`Counts.recent` for ``context`` (every token before a step's first row)."""
    if last_n < 0:
        return tuple(sorted(set(context)))
    return tuple(context[-last_n:]) if last_n else ()


NO_COUNTS = Counts()


GREEDY = Sampling()


@dataclass(frozen=True, slots=True)
class Finalized:
    tokens: tuple[int, ...]   # accepted drafts, then the bonus (or the one sampled token)
    n_accepted: int
    n_drafted: int
    logprobs: TokenLogprobs | None = None   # when the step's sampling asked for them
    scored: TokenLogprobs | None = None     # the logprobs of a step's ``score`` tokens


@dataclass(frozen=True, slots=True)
class SamplingFailed:
    """One session's sampling raised: why (the session's own failure, not the batch's)."""

    reason: str


class FinalSampler:
    """Per-session random generators for the final stage."""

    def __init__(self) -> None:
        self._rngs: dict[int, np.random.Generator] = {}

    def finalize(self, session: int, logits: np.ndarray, drafts: tuple[int, ...],
                 sampling: Sampling, mask: np.ndarray | None = None, seen: Counts = NO_COUNTS,
                 score: tuple[int, ...] = ()) -> Finalized:
        """``logits``: ``(len(drafts) + 1, V)`` rows for ``[last, d1..dk]``; ``mask``:
        None, or the allowed tokens of each of those rows (uint32 words, see apply_mask);
        ``seen``: the tokens generated before ``last``'s row, for the penalties. With
        ``score``, ``len(score)`` rows come first, scored against those tokens (with
        ``sampling.top_logprobs`` alternatives), and when nothing follows them nothing is
        sampled (a prompt chunk before the last)."""
        scored = None
        if score:
            if sampling.top_logprobs is None:
                raise ValueError("prompt tokens scored without logprobs asked for")
            scored = token_logprobs(logits[:len(score)], score, sampling.top_logprobs)
            if logits.shape[0] == len(score):
                return Finalized((), 0, 0, None, scored)
            logits = logits[len(score):]
        rng = None
        if not sampling.greedy:
            rng = self._rngs.get(session)
            if rng is None:
                rng = self._rngs[session] = np.random.default_rng(sampling.seed)
        rows = raw = logits[-(len(drafts) + 1):]
        if sampling.bias_ids:
            rows = apply_bias(rows, sampling.bias_ids, sampling.bias_values)
        if sampling.repeats:
            rows = apply_repetition(rows, drafts, seen.recent, sampling.repeat, sampling.repeat_last_n)
        if sampling.presence or sampling.frequency:
            rows = apply_penalties(rows, drafts, seen, sampling.presence, sampling.frequency)
        if mask is not None:
            if mask.shape[0] != rows.shape[0]:
                raise ValueError(f"{mask.shape[0]} mask rows for {rows.shape[0]} logit rows")
            rows = apply_mask(rows, mask)
        res = verify_logits(rows, drafts, temperature=sampling.temperature,
                            top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p, rng=rng)
        lp = None
        if sampling.top_logprobs is not None:
            # row i is what the i-th emitted token (accepted draft or bonus) came from; the
            # model's own rows, before a bias or a grammar mask (whose -inf would be no
            # number in JSON), as llama.cpp's server reports them
            lp = token_logprobs(raw, res.tokens, sampling.top_logprobs)
        return Finalized(res.tokens, res.n_accepted, len(drafts), lp, scored)

    def finalize_isolated(self, session: int, logits: np.ndarray, drafts: tuple[int, ...],
                          sampling: Sampling, mask: np.ndarray | None = None,
                          seen: Counts = NO_COUNTS, score: tuple[int, ...] = ()) -> Finalized | SamplingFailed:
        """:meth:`finalize`, with a failure returned instead of raised, so that the caller,
        which finalizes every session of one engine call in turn, hands it to this session
        alone. The session's generator is dropped: it may have advanced part way, and the
        request fails anyway."""
        try:
            return self.finalize(session, logits, drafts, sampling, mask, seen, score)
        except Exception as exc:  # noqa: BLE001 - this session's failure, never its batch's
            log.warning("session %x: sampling failed: %s", session, exc, exc_info=not isinstance(exc, ValueError))
            self.forget(session)
            return SamplingFailed(f"sampling failed: {exc}")

    def forget(self, session: int) -> None:
        self._rngs.pop(session, None)


def apply_bias(logits: np.ndarray, ids: tuple[int, ...], values: tuple[float, ...]) -> np.ndarray:
    """``logits`` ``(rows, V)`` with ``values`` added to the columns ``ids`` of every row (a
    new float32 array). An id outside the vocabulary fails the sampling."""
    if ids[-1] >= logits.shape[1]:   # ascending (the wire checks it)
        raise ValueError(f"logit bias for token {ids[-1]}, the vocabulary has {logits.shape[1]}")
    out = np.array(logits, dtype=np.float32)
    out[:, np.asarray(ids, dtype=np.intp)] += np.asarray(values, dtype=np.float32)
    return out


def apply_repetition(logits: np.ndarray, drafts: tuple[int, ...], recent: tuple[int, ...],
                     penalty: float, last_n: int) -> np.ndarray:
    """``logits`` ``(rows, V)`` for ``[last, d1..dk]`` with the repetition penalty applied
    (a new float32 array): in row i, every token among the last ``last_n`` of ``recent``
    followed by ``d1..di`` (-1: all of them) is divided by ``penalty`` where its logit is
    positive and multiplied by it where not (llama.cpp's and vLLM's rule). float32, so one
    node and a split compute the same numbers."""
    rows, vocab = logits.shape
    out = np.array(logits, dtype=np.float32)
    r = np.float32(penalty)
    for i in range(rows):
        window = (*recent, *drafts[:i])
        if last_n >= 0:
            window = window[-last_n:] if last_n else ()
        # (over the whole context, row 0's ids are the step's recent ones: unique, ascending)
        ids = (np.fromiter(recent, np.intp, len(recent)) if last_n < 0 and i == 0
               else np.unique(np.asarray(window, dtype=np.intp)))
        if not ids.size:
            continue
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"a repetition penalty for a token outside the vocabulary of {vocab}")
        v = out[i, ids]
        out[i, ids] = np.where(v > 0, v / r, v * r)
    return out


def apply_penalties(logits: np.ndarray, drafts: tuple[int, ...], seen: Counts,
                    presence: float, frequency: float) -> np.ndarray:
    """``logits`` ``(rows, V)`` for ``[last, d1..dk]`` with OpenAI's penalties taken off (a
    new float32 array): row i's tokens counted in ``seen`` plus ``d1..di`` (the tokens
    that precede it once its drafts are accepted) lose ``presence + frequency * count``.
    An id outside the vocabulary fails the sampling. float32 throughout, so one node and
    a split (which carries the two values as f32) compute the same numbers."""
    rows, vocab = logits.shape
    base = np.asarray(logits, dtype=np.float32)
    out = np.array(base)
    p, f = np.float32(presence), np.float32(frequency)
    ids = np.asarray(seen.ids, dtype=np.intp)
    if ids.size:
        if ids[-1] >= vocab:   # ascending (the wire checks it)
            raise ValueError(f"a penalty for token {int(ids[-1])}, the vocabulary has {vocab}")
        counts = np.asarray(seen.counts, dtype=np.float32)
        out[:, ids] -= f * counts + p   # every row: vectorized, whatever the answer's length
    # then each row's drafts before it, a few tokens, with the same float32 formula
    extra: dict[int, int] = {}
    for i in range(1, rows):
        tok = drafts[i - 1]
        extra[tok] = extra.get(tok, 0) + 1
        for t, n in extra.items():
            at = int(np.searchsorted(ids, t))
            c = n + (seen.counts[at] if at < ids.size and ids[at] == t else 0)
            out[i, t] = base[i, t] - (f * np.float32(c) + p)
    return out


def apply_mask(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``logits`` ``(rows, V)`` with every token outside its row's ``mask`` set to -inf
    (a new float32 array). ``mask``: ``(rows, words)`` uint32, token ``t`` allowed when
    bit ``t % 32`` of word ``t // 32`` is set (llguidance's layout); tokens past the
    mask's bits are not allowed. A row that allows nothing fails the sampling."""
    rows, vocab = logits.shape
    bits = np.unpackbits(np.ascontiguousarray(mask, dtype="<u4").view(np.uint8).reshape(rows, -1),
                         axis=1, count=None, bitorder="little")
    n = min(vocab, bits.shape[1])
    if not bits[:, :n].any(axis=1).all():
        raise ValueError("the grammar allows no token")
    out = np.full((rows, vocab), -np.inf, dtype=np.float32)
    np.copyto(out[:, :n], logits[:, :n], where=bits[:, :n].astype(bool))
    return out
