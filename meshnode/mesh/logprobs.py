"""Log-probabilities of sampled tokens, computed where sampling happens.

The final stage (a single node's whole model, or the last stage of a split) has the
logits rows the sampler used: row ``i`` of a verify window ``[last, d1..dk]`` is the
distribution of the token emitted ``i``-th, whether it is an accepted draft or the bonus,
so a speculative step reports exactly what plain decoding would.

Values are the log-softmax of the raw logits (before temperature, top-k and top-p, as
OpenAI and vLLM report them), the normalizer summed in float64, rounded to float32: that
is what the wire carries, so a single node and a split report bit-identical numbers. Each token's
``n_top`` alternatives are the most likely tokens of its row, most likely first (ties by
lower id).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshnode.limits import MAX_TOP_LOGPROBS


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Per emitted token: its logprob, and ``n_top`` alternatives (flattened row-major)."""

    logprobs: tuple[float, ...]
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    @property
    def n_top(self) -> int:
        return len(self.top_ids) // len(self.logprobs) if self.logprobs else 0

    def top(self, i: int) -> list[tuple[int, float]]:
        """The alternatives of the ``i``-th token: ``[(token id, logprob), ...]``."""
        k = self.n_top
        return list(zip(self.top_ids[i * k:(i + 1) * k], self.top_logprobs[i * k:(i + 1) * k]))

    def head(self, n: int, n_top: int) -> TokenLogprobs:
        """The first ``n`` tokens' entries with ``n_top`` of their alternatives (at most
        :attr:`n_top`). Alternatives are sorted (best first, ties by lower id), so these
        are the entries ``n_top`` alternatives would have given."""
        k = self.n_top
        if n > len(self.logprobs) or n_top > k and n:
            raise ValueError(f"{n} entries with {n_top} alternatives asked of {len(self.logprobs)} with {k}")
        keep = [i * k + j for i in range(n) for j in range(n_top)]
        return TokenLogprobs(self.logprobs[:n], tuple(self.top_ids[x] for x in keep),
                             tuple(self.top_logprobs[x] for x in keep))

    @staticmethod
    def concat(parts: Sequence[TokenLogprobs]) -> TokenLogprobs:
        """``parts`` (each with the same number of alternatives) one after the other."""
        return TokenLogprobs(tuple(x for p in parts for x in p.logprobs), tuple(x for p in parts for x in p.top_ids),
                             tuple(x for p in parts for x in p.top_logprobs))


def _f32(x: np.ndarray) -> tuple[float, ...]:
    return tuple(float(v) for v in np.asarray(x, dtype=np.float32))


def token_logprobs(rows: np.ndarray, tokens: Sequence[int], n_top: int) -> TokenLogprobs:
    """``rows[i]`` are the logits ``tokens[i]`` was sampled from (``len(tokens)`` rows at
    least). Raises ValueError for ``n_top`` outside 0..MAX_TOP_LOGPROBS, a bad shape, a
    token outside the vocabulary or a row that is not finite."""
    if not 0 <= n_top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs {n_top} outside 0..{MAX_TOP_LOGPROBS}")
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[0] < len(tokens):
        raise ValueError(f"need {len(tokens)} logits rows, got shape {rows.shape}")
    if any(not 0 <= t < rows.shape[1] for t in tokens):
        raise ValueError(f"a token id outside the vocabulary of {rows.shape[1]}")
    lps: list[float] = []
    ids: list[int] = []
    tops: list[float] = []
    for i, tok in enumerate(tokens):
        row = rows[i]
        lse = _logsumexp(row)
        lps.append(float(row[int(tok)]) - lse)
        if n_top:
            best = _top(row, n_top)
            ids.extend(int(t) for t in best)
            tops.extend(float(row[t]) - lse for t in best)
    return TokenLogprobs(_f32(np.array(lps)), tuple(ids), _f32(np.array(tops)) if tops else ())


def _logsumexp(row: np.ndarray) -> float:
    """log(sum(exp(row))): the exponentials at the row's precision (vectorized: ~70 us for
    49k float32 logits, against ~500 us in float64), summed in float64; well inside the
    float32 the result is rounded to."""
    m = float(row.max())
    if not math.isfinite(m):
        raise ValueError("a logits row that is not finite")
    return m + math.log(float(np.exp(row - row.dtype.type(m)).sum(dtype=np.float64)))


# How far below the row's best logit _top looks first, then twice as far each time: a
# model's top few lie within a few logits of the best, so the first looks find them.
_TOP_SPAN = 4.0


def _top(row: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` largest entries' ids, largest first, ties by lower id: those within a
    span of the best, then sorted (a scan of the row instead of a partition of all of it:
    ~20 us against ~700 us for 49k logits)."""
    n = min(n, row.size)
    best = row.max()
    span = _TOP_SPAN
    while True:
        cand = np.flatnonzero(row >= best - span)         # ids ascending
        if cand.size >= n or not math.isfinite(span):
            break
        span = span * 2 if span < 1e6 else math.inf
    order = np.argsort(-row[cand], kind="stable")[:n]    # stable: ties keep the lower id first
    return cand[order]
