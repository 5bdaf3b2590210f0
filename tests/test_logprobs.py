"""meshnode.mesh.logprobs: the log-softmax and top alternatives the final stage reports,
against a plain float64 definition (pure logic)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.mesh.logprobs import token_logprobs


def _reference(row: np.ndarray, tok: int, n_top: int) -> tuple[float, list[int], list[float]]:
    r = row.astype(np.float64)
    m = r.max()
    lp = r - (m + np.log(np.exp(r - m).sum()))
    top = sorted(range(r.size), key=lambda j: (-lp[j], j))[:n_top]   # ties: lower id first
    return lp[tok], top, [lp[j] for j in top]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.integers(1, 3000), scale=st.sampled_from([0.01, 1.0, 8.0, 60.0]),
       n_top=st.integers(0, 20), ties=st.booleans())
def test_logprobs_and_alternatives_are_the_definitions(seed, vocab, scale, n_top, ties):
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((3, vocab)) * scale).astype(np.float32)
    if ties:                  # many equal logits: the alternatives' order is by id
        rows = np.round(rows)
    toks = [int(t) for t in rng.integers(0, vocab, 3)]
    got = token_logprobs(rows, toks, n_top)
    for i, tok in enumerate(toks):
        lp, top, top_lps = _reference(rows[i], tok, n_top)
        # the normalizer is summed in float64 and the value rounded to float32
        assert got.logprobs[i] == pytest.approx(lp, rel=1e-6, abs=1e-6)
        assert [t for t, _ in got.top(i)] == top
        assert [v for _, v in got.top(i)] == pytest.approx(top_lps, rel=1e-6, abs=1e-6)
        # a row alone gives what it gives in a batch of rows (a verify window, a scored chunk)
        alone = token_logprobs(rows[i:i + 1], [tok], n_top)
        assert (alone.logprobs[0], alone.top(0)) == (got.logprobs[i], got.top(i))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_row_that_is_not_finite_is_refused(bad):
    rows = np.zeros((1, 8), np.float32)
    rows[0, 3] = bad
    with pytest.raises(ValueError, match="finite"):
        token_logprobs(rows, [1], 2)


def test_bad_tokens_and_shapes_are_refused():
    rows = np.zeros((2, 8), np.float32)
    for tokens, n_top, what in (([8], 0, "vocabulary"), ([1, 2, 3], 0, "rows"), ([1], 21, "top_logprobs")):
        with pytest.raises(ValueError, match=what):
            token_logprobs(rows, tokens, n_top)


def test_head_and_concat_give_what_fewer_rows_and_alternatives_compute():
    rng = np.random.default_rng(7)
    rows = rng.normal(size=(6, 300)).astype(np.float32)
    toks = [int(t) for t in rng.integers(0, 300, 6)]
    full = token_logprobs(rows, toks, 5)
    for n, k in [(0, 0), (3, 0), (4, 2), (6, 5)]:
        assert full.head(n, k) == token_logprobs(rows[:n], toks[:n], k)
    parts = [token_logprobs(rows[:2], toks[:2], 5), token_logprobs(rows[2:], toks[2:], 5)]
    assert type(full).concat(parts) == full
    with pytest.raises(ValueError):
        full.head(7, 5)      # more entries than it has
    with pytest.raises(ValueError):
        full.head(2, 6)      # more alternatives than it has
