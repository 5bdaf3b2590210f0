"""Sampling, greedy verification and the speculative-sampling rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.spec.acceptance import (
    VerifyResult,
    probs,
    sample,
    verify_greedy,
    verify_logits,
    verify_sampled,
)
from meshnode.spec.ngram import NGramProposer
from meshnode.spec.window import AdaptiveWindow


def chi2_critical(df: int, z: float = 3.72) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z = 3.72: p ~ 1e-4)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def assert_distribution(counts: np.ndarray, p: np.ndarray) -> None:
    """Zero-probability cells are never hit; the rest pass a chi-square test."""
    n = counts.sum()
    assert n > 0
    assert counts[p == 0].sum() == 0, (counts, p)
    exp = p * n
    big = exp >= 5
    obs = list(counts[big])
    ex = list(exp[big])
    if (~big & (p > 0)).any():  # lump sparse cells together
        obs.append(counts[~big & (p > 0)].sum())
        ex.append(exp[~big & (p > 0)].sum())
    if len(obs) < 2:
        return
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, ex))
    assert stat < chi2_critical(len(obs) - 1), (stat, obs, ex)


# ---- probs / sample -----------------------------------------------------------


def test_greedy_probs_is_one_hot_first_argmax():
    p = probs([1.0, 3.0, 3.0, -2.0], 0.0)
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert sample([1.0, 3.0, 3.0, -2.0], 0.0, 0, 1.0, np.random.default_rng(0)) == 1


def test_probs_softmax_temperature_and_stability():
    logits = np.array([1000.0, 999.0, -np.inf, 998.0])
    p = probs(logits, 1.0)
    assert p.dtype == np.float64 and p.sum() == pytest.approx(1.0)
    e = np.exp([0.0, -1.0, -2.0])
    assert p[[0, 1, 3]] == pytest.approx(e / e.sum())
    assert p[2] == 0.0
    hot = probs(logits, 0.5)
    assert hot[0] > p[0]


def test_top_k_and_top_p():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = probs(logits, 1.0, top_k=2)
    assert p == pytest.approx([0.5 / 0.7, 0.2 / 0.7, 0, 0, 0])
    p = probs(logits, 1.0, top_p=0.8)  # 0.5 + 0.2 = 0.7 < 0.8: need 3 tokens
    assert p == pytest.approx(np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    p = probs(logits, 1.0, top_p=0.7)  # exactly reached by 2 tokens
    assert np.count_nonzero(p) == 2
    p = probs(logits, 1.0, top_p=0.01)
    assert p.tolist() == [1.0, 0, 0, 0, 0]
    # top-p is judged on the untempered distribution (llama.cpp order)
    p_hot = probs(logits, 0.1, top_p=0.8)
    assert np.count_nonzero(p_hot) == 3


def test_min_p_drops_what_is_less_probable_than_a_share_of_the_best():
    row = np.log([1.0, 0.5, 0.04, 0.1, 0.2])
    p = probs(row, 1.0, min_p=0.1)
    assert p[2] == 0 and (p[[0, 1, 3, 4]] > 0).all()
    assert p[0] / p[1] == pytest.approx(2.0)           # the rest keep their ratios
    assert np.flatnonzero(probs(row, 1.0, min_p=1.0)).tolist() == [0]
    # after top-k (here only two candidates) and before the temperature
    p = probs(row, 5.0, top_k=2, min_p=0.6)
    assert np.flatnonzero(p).tolist() == [0]
    assert np.array_equal(probs(row, 0.7, min_p=0.0), probs(row, 0.7))


def test_top_p_large_vocab_head_and_fallback():
    rng = np.random.default_rng(5)
    peaked = rng.normal(size=5000)
    peaked[:3] += 30.0  # nearly all mass in 3 tokens: the head shortcut applies
    p = probs(peaked, 1.0, top_p=0.9)
    assert set(np.flatnonzero(p)) <= {0, 1, 2}
    flat = rng.normal(size=5000) * 0.01  # mass spread out: full sort needed
    p = probs(flat, 1.0, top_p=0.5)
    q = np.exp(flat - flat.max())
    q /= q.sum()
    order = np.argsort(-q, kind="stable")
    n = int(np.searchsorted(np.cumsum(q[order]), 0.5)) + 1
    assert np.count_nonzero(p) == n
    assert set(np.flatnonzero(p)) == set(order[:n].tolist())


@pytest.mark.parametrize("bad", [[], [np.nan, 1.0], [np.inf, 1.0], [-np.inf, -np.inf]])
def test_bad_logits_raise(bad):
    with pytest.raises(ValueError):
        probs(bad, 1.0)


def test_sample_frequencies_match_probs():
    rng = np.random.default_rng(1234)
    logits = np.array([0.3, -1.0, 2.0, 0.0, 1.1, -np.inf])
    p = probs(logits, 0.8, top_k=5, top_p=0.95)
    counts = np.bincount([sample(logits, 0.8, 5, 0.95, rng) for _ in range(20_000)], minlength=6)
    assert_distribution(counts, p)


# ---- greedy verification --------------------------------------------------------


def test_verify_greedy():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == 3
    assert verify_greedy([5, 6, 7, 8], [5, 9, 7]) == 1
    assert verify_greedy([5, 6], [4]) == 0
    assert verify_greedy([5], []) == 0
    with pytest.raises(ValueError):
        verify_greedy([5, 6], [5, 6])


def _target(ctx: list[int], v: int) -> int:
    """A deterministic toy 'model': argmax depends on the last two tokens."""
    a, b = (ctx[-2:] + [0, 0])[:2] if len(ctx) < 2 else ctx[-2:]
    return (a * 7 + b * 3 + (a * b) % 5) % v


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 5), min_size=1, max_size=30), v=st.integers(2, 6))
def test_speculative_greedy_equals_plain_greedy(prompt, v):
    """n-gram drafts + verify_greedy + adaptive window emit exactly plain greedy output."""
    n_out = 60
    plain = list(prompt)
    while len(plain) < len(prompt) + n_out:
        plain.append(_target(plain, v))

    ctx = list(prompt)
    ng = NGramProposer(prompt, max_n=3)
    win = AdaptiveWindow(4, 1, 8)
    while len(ctx) < len(prompt) + n_out:
        drafts = ng.propose(win.next_window())
        rows = [_target(ctx + drafts[:i], v) for i in range(len(drafts) + 1)]
        n = verify_greedy(rows, drafts)
        emitted = drafts[:n] + [rows[n]]
        win.update(len(drafts), n)
        ctx.extend(emitted)
        ng.observe(emitted)
    assert ctx[: len(plain)] == plain


def test_verify_logits_greedy_and_rng_required():
    logits = np.array([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    r = verify_logits(logits, [1, 2], temperature=0.0)
    assert r == VerifyResult((1,), 0) and r.tokens == (1, 0) and r.n_accepted == 1
    with pytest.raises(ValueError):
        verify_logits(logits, [1, 2], temperature=1.0)
    with pytest.raises(ValueError):
        verify_logits(logits[:2], [1, 2], temperature=0.0)


# ---- sampled verification: distribution preservation ------------------------


def test_verify_sampled_certain_draft_always_accepted():
    p = np.array([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    rng = np.random.default_rng(0)
    for _ in range(100):
        acc, bonus = verify_sampled(p, [1], rng)
        assert acc == [1] and bonus in (0, 1, 2)
    acc, bonus = verify_sampled(np.array([[0.0, 0.0, 1.0], [1.0, 0, 0]]), [1], rng)
    assert acc == [] and bonus == 2  # impossible draft: rejected, residual sampled


def test_verify_sampled_bad_shapes():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError):
        verify_sampled(np.ones((1, 3)) / 3, [0], rng)
    with pytest.raises(ValueError):
        verify_sampled(np.ones((2, 3)) / 3, [7], rng)


prob_rows = st.integers(2, 5).flatmap(
    lambda v: st.lists(
        st.lists(st.sampled_from([0.0, 0.05, 0.1, 0.3, 1.0, 2.0]), min_size=v, max_size=v).filter(
            lambda r: sum(r) > 0
        ),
        min_size=3,
        max_size=3,
    )
)


@settings(max_examples=25, deadline=None)
@given(rows=prob_rows, data=st.data())
def test_verify_sampled_preserves_target_distribution(rows, data):
    """First emitted token ~ p0; second emitted token, given the first was d1, ~ p1."""
    p = np.array(rows, dtype=np.float64)
    p /= p.sum(axis=1, keepdims=True)
    v = p.shape[1]
    drafts = data.draw(st.lists(st.integers(0, v - 1), min_size=2, max_size=2))
    rng = np.random.default_rng(20240601)
    n = 6000
    first = np.zeros(v, dtype=np.int64)
    second = np.zeros(v, dtype=np.int64)
    for _ in range(n):
        acc, bonus = verify_sampled(p, drafts, rng)
        out = acc + [bonus]
        assert len(out) == len(acc) + 1 and acc == drafts[: len(acc)]
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    assert_distribution(first, p[0])
    if second.sum() >= 200:
        assert_distribution(second, p[1])


def test_verify_logits_sampled_matches_probs():
    rng = np.random.default_rng(99)
    logits = np.array([[2.0, 1.0, 0.0, -1.0], [0.0, 0.5, 1.0, 1.5]])
    p0 = probs(logits[0], 0.7, 3, 0.9)
    counts = np.zeros(4, dtype=np.int64)
    for _ in range(4000):
        r = verify_logits(logits, [1], temperature=0.7, top_k=3, top_p=0.9, rng=rng)
        counts[r.tokens[0]] += 1
    assert_distribution(counts, p0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-1e4, max_value=1e4, width=32), min_size=1, max_size=64),
       st.sampled_from([np.float32, np.float16, np.float64]))
def test_greedy_token_is_the_argmax_of_the_float64_row(values, dtype):
    from meshnode.spec.acceptance import _as_row, greedy_token

    row = np.asarray(values, dtype=dtype)
    assert greedy_token(row) == int(np.argmax(_as_row(row)))   # ties: the first index too


@pytest.mark.parametrize("bad, message", [
    ([1.0, float("nan"), 2.0], "NaN"), ([float("inf"), 1.0], "+inf"),
    ([-float("inf")] * 3, "-inf"), ([], "non-empty")])
def test_greedy_token_rejects_what_as_row_rejects(bad, message):
    from meshnode.spec.acceptance import greedy_token

    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        greedy_token(np.asarray(bad, dtype=np.float32))


# ---- the two-level inverse-CDF draw ----------------------------------------------


class _FixedUniform:
    """An rng whose every uniform is ``u``."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


def _plain_draw(p: np.ndarray, u: float) -> int:
    cum = np.cumsum(p)
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return i if i < p.size and p[i] > 0 else int(np.flatnonzero(p > 0)[-1])


def test_the_two_level_draw_picks_what_a_plain_inverse_cdf_does():
    from meshnode.spec.acceptance import _DRAW_BLOCK, _draw

    rng = np.random.default_rng(3)
    for size in (1, 7, _DRAW_BLOCK, _DRAW_BLOCK + 1, 5 * _DRAW_BLOCK + 17):
        p = rng.random(size) ** 4
        p[rng.random(size) < 0.3] = 0.0          # zero weights, some at block edges
        p[-1] = 0.0
        if not p.any():
            p[0] = 1.0
        cum = np.cumsum(p)
        for u in (*rng.random(200), 0.0, 0.9999999999999999):
            got, want = _draw(p, _FixedUniform(u)), _plain_draw(p, u)
            assert p[got] > 0
            # the same index, but where rounding puts u on a boundary (then a neighbour)
            assert got == want or abs(cum[min(got, want)] - u * cum[-1]) < 1e-9 * cum[-1], (size, u, got, want)


def test_a_draw_from_nothing_is_refused():
    from meshnode.spec.acceptance import _draw

    with pytest.raises(ValueError, match="zero distribution"):
        _draw(np.zeros(3000), _FixedUniform(0.5))


def _top_p_reference(row: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """top-p by its definition: the whole vocabulary sorted (stable), then tempered."""
    row = np.asarray(row, dtype=np.float64)
    p = np.exp(row - row.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    n = int(np.searchsorted(np.cumsum(p[order]), top_p, side="left")) + 1
    keep = order[:min(n, order.size)]
    z = row[keep] / temperature
    out = np.zeros(row.size)
    out[keep] = np.exp(z - z.max())
    return out / out.sum()


@pytest.mark.parametrize("shape", ["peaked", "flat", "ties", "two_peaks"])
def test_top_p_sorts_only_the_head_yet_equals_the_definition(shape):
    rng = np.random.default_rng(11)
    for trial in range(20):
        v = int(rng.integers(2, 70_000))
        row = rng.standard_normal(v) * {"peaked": 4.0, "flat": 0.05, "ties": 2.0, "two_peaks": 1.0}[shape]
        if shape == "ties":
            row = np.round(row)                   # many equal logits: stable order decides
        if shape == "two_peaks":
            row[rng.integers(0, v, 2)] += 12.0
        for top_p in (0.5, 0.9, 0.95, 0.999):
            got = probs(row.astype(np.float32), 0.8, top_p=top_p)
            assert np.array_equal(got, _top_p_reference(row.astype(np.float32), 0.8, top_p)), (shape, trial, v, top_p)


def test_probs_leaves_the_callers_logits_alone():
    # probs works in place on its own float64 copy: a float64 row passed in stays as it was
    row = np.random.default_rng(2).standard_normal(3000)
    before = row.copy()
    probs(row, 0.7)
    probs(row, 0.7, top_k=50)
    probs(row, 1.3, top_p=0.8)
    assert np.array_equal(row, before)
    z = row / 0.7                               # and gives the out-of-place softmax, bit for bit
    ref = np.exp(z - z.max())
    assert np.array_equal(probs(row, 0.7), ref / ref.sum())
