"""Sampling and the speculative acceptance rule (runs on the final stage).

Theory of operation: stage 0 sends ``[last, d1..dk]`` as one verify batch. Row ``i``
of the target's logits is the distribution of the token after position ``i``, so row
``i`` judges draft ``d_{i+1}`` and row ``k`` (after the last draft) yields the bonus.

Greedy (temperature <= 0): ``d_{i+1}`` is accepted iff it equals the argmax of row
``i``; the first mismatch stops the window and the argmax of that row is the bonus.
The accepted prefix plus bonus is exactly what plain greedy decoding would emit.

Sampled (temperature > 0): the speculative-sampling rule (Leviathan et al. 2023,
Chen et al. 2023) accepts ``d`` with probability ``min(1, p(d) / q(d))`` and on
rejection samples from ``normalise(max(0, p - q))``. Our drafts are deterministic
(the n-gram continuation, or the draft model's argmax), so ``q`` is one-hot on ``d``:
accept with probability ``p(d)``; on rejection sample from ``p`` with ``d`` removed
and renormalised. Then ``P(d) = p(d)`` and ``P(x) = (1 - p(d)) p(x) / (1 - p(d)) =
p(x)`` for ``x != d``: each emitted token has exactly the target distribution.

``probs`` follows llama.cpp's sampler order so a single node and a mesh agree:
top-k, then top-p (on the untempered distribution), then temperature. All arithmetic
is float64; the max logit is subtracted before ``exp``. ``rng`` is a
``numpy.random.Generator`` passed in by the caller (seeded per request).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "VerifyResult",
    "probs",
    "sample",
    "verify_greedy",
    "verify_logits",
    "verify_sampled",
]


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Tokens to emit for one verify window: ``accepted`` drafts, then ``bonus``."""

    accepted: tuple[int, ...]
    bonus: int

    @property
    def n_accepted(self) -> int:
        return len(self.accepted)

    @property
    def tokens(self) -> tuple[int, ...]:
        return (*self.accepted, self.bonus)


_TOP_P_PRESELECT = 256


def _as_row(logits_row: np.ndarray | Sequence[float]) -> np.ndarray:
    row = np.asarray(logits_row, dtype=np.float64)
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"expected a non-empty 1-D logits row, got shape {row.shape}")
    if np.isnan(row).any():
        raise ValueError("logits contain NaN")
    if not np.isfinite(row.max()):
        if row.max() == -np.inf:
            raise ValueError("every logit is -inf")
        raise ValueError("logits contain +inf")
    return row


def greedy_token(logits_row: np.ndarray) -> int:
    """The argmax of one row of logits, with :func:`_as_row`'s checks.

    The hot path of greedy decoding (one call per emitted token at the final stage), so
    it stays in the row's own dtype: a float64 copy plus NaN/inf passes over a 49k-token
    vocabulary cost more than the argmax itself. NumPy's argmax returns the first NaN if
    there is one, so checking the picked value alone rejects NaN, +inf and all -inf
    rows, as :func:`_as_row` does; the index is the same as on a float64 copy (the
    conversion is exact, and ties go to the first index either way)."""
    row = np.asarray(logits_row)
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"expected a non-empty 1-D logits row, got shape {row.shape}")
    i = int(row.argmax())
    if not np.isfinite(row[i]):
        _as_row(row)   # raises the precise error
    return i


def probs(
    logits_row: np.ndarray | Sequence[float],
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> np.ndarray:
    """The sampling distribution (float64, sums to 1) for one row of logits.

    ``temperature <= 0``: one-hot on the argmax (lowest index on ties).
    ``top_k <= 0`` or ``>= vocab`` and ``top_p >= 1`` disable those filters; ``min_p``
    (llama.cpp's, after them and before the temperature, as its default sampler chain)
    drops the tokens less probable than ``min_p`` times the most probable one, 0 is off.
    Raises ``ValueError`` for NaN / +inf / all -inf logits or ``top_p <= 0``.
    """
    row = _as_row(logits_row)
    v = row.size
    if temperature <= 0:
        out = np.zeros(v, dtype=np.float64)
        out[int(np.argmax(row))] = 1.0
        return out
    if not top_p > 0:
        raise ValueError(f"top_p must be > 0, got {top_p}")
    keep: np.ndarray | None = None  # indices kept; None: the whole vocabulary
    if 0 < top_k < v:
        keep = np.argpartition(-row, top_k - 1)[:top_k]  # O(V), no full sort
    if top_p < 1.0:
        cand = keep if keep is not None else np.arange(v)
        vals = row[cand]
        p = np.exp(vals - vals.max())
        p /= p.sum()
        sub = np.arange(cand.size)
        for tau in _top_p_thresholds(p):
            # Real distributions are peaked: the few tokens of probability >= tau usually
            # hold top_p of the mass. Every other token is less probable than each of
            # them, so the prefix sought lies among them, in the same stable order: sort
            # only those, not the vocabulary.
            head = np.flatnonzero(p >= tau)
            if p[head].sum() >= top_p:
                sub = head
                break
        order = sub[np.argsort(-p[sub], kind="stable")]
        cum = np.cumsum(p[order])
        # smallest prefix whose mass reaches top_p (always at least one token)
        n_keep = int(np.searchsorted(cum, top_p, side="left")) + 1
        keep = cand[order[: min(n_keep, order.size)]]
    if min_p > 0.0:
        # p_i >= min_p * p_max  <=>  logit_i >= max logit + log(min_p): the argmax stays
        floor = row.max() + np.log(min_p)
        keep = np.flatnonzero(row >= floor) if keep is None else keep[row[keep] >= floor]
    # in place: no new vocabulary-sized temporaries (each is ~0.4 MB of fresh pages for a
    # 49k vocabulary); the same operations in the same order, so the same bits
    if keep is not None:
        z = row[keep]                       # fancy indexing: already a copy
    else:                                   # _as_row returns a float64 input itself
        z = row.copy() if row is logits_row else row
    z /= temperature
    z -= z.max()
    np.exp(z, out=z)
    if keep is None:
        out = z
    else:
        out = np.zeros(v, dtype=np.float64)
        out[keep] = z
    out /= out.sum()
    return out


_DRAW_BLOCK = 1024


def _top_p_thresholds(p: np.ndarray):
    """Probabilities to cut a top-p head at, cheapest first: 1/256 (at most 256 tokens are
    that probable: one comparison over the vocabulary), then the 256th, 4096th and
    65536th largest probabilities (a partition each, ~0.15 ms over 49k). None for a
    vocabulary that small: the caller sorts it whole."""
    m = _TOP_P_PRESELECT
    if p.size > m:
        yield 1.0 / m
    while m < p.size:
        yield np.partition(p, p.size - m)[p.size - m]
        m *= 16


def _draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw from an (unnormalised, non-negative) distribution.

    In two levels, sums of blocks of :data:`_DRAW_BLOCK` weights and then the cumulative
    sums of the one block the draw falls in: a float64 ``cumsum`` over the vocabulary took
    110 us a sampled token for 49k entries and 296 us for 128k on the 2-core VM, the two
    levels 20 and 36 us. One ``rng.random()`` per draw, as a plain inverse CDF; the index
    differs from it only where rounding puts the uniform within ~1e-16 of a boundary."""
    n = p.size
    starts = np.arange(0, n, _DRAW_BLOCK)
    cum = np.cumsum(np.add.reduceat(p, starts), dtype=np.float64)
    total = cum[-1]
    if not total > 0:
        raise ValueError("cannot sample from a zero distribution")
    u = rng.random() * total
    b = min(int(np.searchsorted(cum, u, side="right")), cum.size - 1)   # u rounded up to total
    lo = int(starts[b])
    block = p[lo:lo + _DRAW_BLOCK]
    inner = (cum[b - 1] if b else 0.0) + np.cumsum(block, dtype=np.float64)
    idx = lo + min(int(np.searchsorted(inner, u, side="right")), block.size - 1)
    if p[idx] <= 0:   # rounding landed on a zero weight: the block's last positive one
        positive = np.flatnonzero(block > 0)
        idx = lo + int(positive[-1]) if positive.size else int(np.flatnonzero(p > 0)[-1])
    return idx


def sample(
    logits_row: np.ndarray | Sequence[float],
    temperature: float,
    top_k: int,
    top_p: float,
    rng: np.random.Generator,
    min_p: float = 0.0,
) -> int:
    """One token id from ``logits_row``; the argmax when ``temperature <= 0`` (rng unused)."""
    if temperature <= 0:
        return int(np.argmax(_as_row(logits_row)))
    return _draw(probs(logits_row, temperature, top_k, top_p, min_p), rng)


def verify_greedy(target_argmax: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts greedy decoding would have produced.

    ``target_argmax[i]`` is the target's argmax after position ``i`` of ``[last, d1..dk]``
    (so ``len(target_argmax) >= len(drafts) + 1``). The bonus token is
    ``target_argmax[n_accepted]``. Raises ``ValueError`` when too few rows are given.
    """
    if len(target_argmax) < len(drafts) + 1:
        raise ValueError(
            f"need {len(drafts) + 1} target rows for {len(drafts)} drafts, got {len(target_argmax)}"
        )
    n = 0
    for t, d in zip(target_argmax, drafts):
        if int(t) != int(d):
            break
        n += 1
    return n


def verify_sampled(
    target_probs: np.ndarray,
    drafts: Sequence[int],
    rng: np.random.Generator,
) -> tuple[list[int], int]:
    """Speculative sampling with deterministic drafts: ``(accepted_tokens, bonus_token)``.

    ``target_probs`` is ``(k + 1, V)``: row ``i`` is the target distribution (from
    :func:`probs`) after position ``i`` of ``[last, d1..dk]``. Emitting
    ``accepted_tokens + [bonus_token]`` samples each token from the target
    distribution exactly. Raises ``ValueError`` on a shape mismatch.
    """
    p = np.asarray(target_probs, dtype=np.float64)
    k = len(drafts)
    if p.ndim != 2 or p.shape[0] < k + 1:
        raise ValueError(f"need target_probs of shape ({k + 1}, V), got {p.shape}")
    v = p.shape[1]
    accepted: list[int] = []
    for i, d in enumerate(drafts):
        d = int(d)
        if not 0 <= d < v:
            raise ValueError(f"draft token {d} outside vocabulary of {v}")
        row = p[i]
        total = row.sum()
        if rng.random() * total < row[d]:
            accepted.append(d)
            continue
        residual = row.copy()
        residual[d] = 0.0
        return accepted, _draw(residual, rng)
    return accepted, _draw(p[k], rng)


def verify_logits(
    logits: np.ndarray,
    drafts: Sequence[int],
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    rng: np.random.Generator | None = None,
) -> VerifyResult:
    """Verify one window from raw logits ``(k + 1, V)``: greedy or sampled by temperature.

    ``rng`` is required when ``temperature > 0`` (``ValueError`` otherwise).
    """
    rows = np.asarray(logits)
    k = len(drafts)
    if rows.ndim != 2 or rows.shape[0] < k + 1:
        raise ValueError(f"need logits of shape ({k + 1}, V), got {rows.shape}")
    if temperature <= 0:
        am = [greedy_token(rows[i]) for i in range(k + 1)]
        n = verify_greedy(am, drafts)
        return VerifyResult(tuple(int(d) for d in drafts[:n]), am[n])
    if rng is None:
        raise ValueError("rng is required when temperature > 0")
    # Rows are only needed up to the first rejection, but computing them lazily would
    # change how many rng draws happen per row, not the distribution; keep it simple.
    p = np.stack([probs(rows[i], temperature, top_k, top_p, min_p) for i in range(k + 1)])
    acc, bonus = verify_sampled(p, drafts, rng)
    return VerifyResult(tuple(acc), bonus)
