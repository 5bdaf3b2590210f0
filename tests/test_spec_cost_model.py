"""CostModel: the prior, interpolation, EWMA and the best window."""

from __future__ import annotations

import pytest

from meshnode.spec.cost_model import CostModel, expected_tokens


def test_expected_tokens():
    assert expected_tokens(0, 0.9) == 1.0
    assert expected_tokens(3, 1.0) == 4.0
    assert expected_tokens(3, 0.0) == 1.0
    assert expected_tokens(2, 0.5) == pytest.approx(1 + 0.5 + 0.25)


def test_cost_prior_and_interpolation():
    c = CostModel(step_s=0.01, hop_s=0.005, row_slope=0.5)
    assert c.seconds(0) == pytest.approx(0.015)
    assert c.seconds(4) == pytest.approx(0.005 + 0.01 * 3)
    c.observe(2, 0.030)
    # one observation: the prior's per-row cost, relative to its cost there
    row = 0.030 * (c.prior(3) - c.prior(2)) / c.prior(2)
    assert c.seconds(4) == pytest.approx(0.030 + 2 * row)
    assert c.seconds(1) == pytest.approx(0.030 * c.prior(1) / c.prior(2))
    c.observe(8, 0.090)
    assert c.seconds(5) == pytest.approx(0.060)  # interpolated
    assert c.seconds(10) == pytest.approx(0.110)  # extrapolated by the fitted slope
    assert c.seconds(0) == pytest.approx(0.010)
    c.observe(2, 0.050)  # EWMA, alpha 0.25
    assert c.observed[2] == pytest.approx(0.035)
    with pytest.raises(ValueError):
        c.observe(33, 0.1)


def test_measured_cpu_curve_best_window():
    # measured on one node, CPU: k+1 rows -> ms
    c = CostModel()
    for rows, ms in ((1, 8.2), (2, 15.3), (4, 22.6), (8, 37.6), (16, 66.0), (32, 128.0)):
        c.observe(rows - 1, ms / 1000)
    assert c.relative(7) == pytest.approx(37.6 / 8.2)
    # low acceptance: speculation never pays on one CPU node, smallest window wins
    assert c.speedup(c.best_window(0.5), 0.5) < 1
    # near-perfect acceptance: long windows pay
    assert c.best_window(0.98, 1, 31) >= 10
    # with 20 ms of hops per step, moderate acceptance already likes mid windows
    hop = CostModel()
    for rows, ms in ((1, 8.2), (2, 15.3), (4, 22.6), (8, 37.6), (16, 66.0), (32, 128.0)):
        hop.observe(rows - 1, ms / 1000 + 0.020)
    k = hop.best_window(0.8, 1, 31)
    assert 3 <= k <= 15 and hop.speedup(k, 0.8) > 1.3


def test_plain_step_gap_is_not_a_row_cost():
    # A GPU split (measured): plain steps take the fast lane, windows QUIC streams, rows
    # are nearly free. The plain-to-window gap must not be read as a cost per row.
    c = CostModel()
    c.observe(0, 0.0038)
    c.observe(1, 0.0052)
    assert c.seconds(3) < 0.0052 * 2          # the prior's relative row cost, not 1.4 ms a row
    c.observe(2, 0.0053)
    assert c.seconds(6) == pytest.approx(0.0053 + 4 * 0.0001)   # fitted over the windows only
    assert c.best_window(0.7, 1, 7) == 7


def test_best_window_tries_the_next_size_once():
    c = CostModel()
    c.observe(0, 0.0038)
    c.observe(1, 0.0052)
    # 2 is unmeasured: costed as 1 was, so it is tried...
    assert c.best_window(0.6, 1, 7) == 2
    # ...and once measured as expensive, it is not taken again (nor anything wider)
    c.observe(2, 0.0090)
    assert c.best_window(0.6, 1, 7) == 1
    # no optimism without a measurement: the prior decides
    assert CostModel().best_window(0.7, 1, 7) == CostModel().best_window(0.7, 1, 7)


@pytest.mark.parametrize("name, cost_ms, acceptance, want", [
    # GPU split: plain 3.8 ms on the lane, a window 5.2 ms + 0.1 ms a draft: wide windows
    ("gpu", lambda k: 3.8 if k == 0 else 5.2 + 0.1 * (k - 1), 0.8, range(5, 8)),
    ("gpu, less accepted", lambda k: 3.8 if k == 0 else 5.2 + 0.1 * (k - 1), 0.65, range(3, 8)),
    # one CPU thread, a small model: each row costs half a step, hops 10 ms: narrow ones
    ("cpu", lambda k: 10.0 + 20.0 * (1 + 0.5 * k) + (0.8 if k else 0.0), 0.6, range(1, 4)),
])
def test_adaptive_window_finds_the_route_best(name, cost_ms, acceptance, want):
    """The window controller against a route with known costs, drafts accepted at a
    fixed per-token rate (seeded): where it settles is near the best fixed window."""
    import random

    from meshnode.spec.window import AdaptiveWindow

    rng = random.Random(7)
    cost = CostModel()
    w = AdaptiveWindow(4, 1, 7, cost=cost)
    cost.observe(0, cost_ms(0) / 1000)
    picks = []
    for _ in range(300):
        k = w.next_window()
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        cost.observe(k, cost_ms(k) / 1000)
        w.update(k, accepted)
        picks.append(k)
    settled = max(set(picks[-100:]), key=picks[-100:].count)
    assert settled in want, (name, settled, cost.observed)
