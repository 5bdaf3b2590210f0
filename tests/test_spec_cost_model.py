"""CostModel: the prior, interpolation, EWMA and the best window."""

from __future__ import annotations

import pytest

from meshnode.spec.cost_model import OUTLIER, CostModel, expected_tokens


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
    # one observation: the prior's shape shifted through it
    assert c.seconds(4) == pytest.approx(0.030 + c.prior(4) - c.prior(2))
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


def test_a_window_s_fixed_cost_is_not_charged_to_each_further_draft():
    """Above the widest measured window the slope among verify windows extends the
    curve, not the slope from a plain step: a window has fixed costs (the draft model's
    catch-up call, the verify's bookkeeping). The numbers: an H200's plain step (14.2 ms)
    and a draft model's window (~21 ms at about one draft); extending 6.8 ms per draft
    would keep the window at one draft, never measured wider."""
    c = CostModel(hop_s=0.0)
    c.observe(0, 0.0142)
    c.observe(1, 0.0210)
    # one window size measured: the prior's per-draft cost through it, so a wider window
    # looks worth a try at a good acceptance
    assert c.seconds(2) == pytest.approx(0.0210 + c.prior(2) - c.prior(1))
    assert c.best_window(0.78, 1, 3) >= 2
    # measured wider: the verify windows' own slope (1 ms per draft here)
    c.observe(2, 0.0220)
    assert c.seconds(3) == pytest.approx(0.0230)
    assert c.best_window(0.78, 1, 3) == 3
    # below the smallest measured window, the fit over every measured one (as before)
    d = CostModel()
    d.observe(2, 0.030)
    d.observe(8, 0.090)
    assert d.seconds(0) == pytest.approx(0.010)


def test_a_fast_route_measured_at_one_draft_still_tries_two():
    # a GPU node: a plain step 2.0 ms, one draft 2.1 ms; the prior's CPU cost per extra
    # draft (0.45 of its 8.2 ms step) would price two drafts at 5.8 ms, so a window at one
    # draft would never grow to be measured
    gpu = CostModel(hop_s=0.0)
    gpu.observe(0, 0.0020)
    gpu.observe(1, 0.0021)
    assert gpu.seconds(2) == pytest.approx(0.0022)
    assert gpu.best_window(0.8) > 1
    # a CPU node, whose first draft cost more than the prior says: the prior's slope stands
    cpu = CostModel(hop_s=0.0)
    cpu.observe(0, 0.0092)
    cpu.observe(1, 0.0172)
    assert cpu.seconds(2) == pytest.approx(0.0172 + cpu.prior(2) - cpu.prior(1))


def test_one_step_slowed_by_other_work_does_not_shut_its_window_out():
    # a 2-draft window measured while a build took the cores (1.3 s instead of ~30 ms)
    c = CostModel()
    for k, ms in ((0, 16.0), (1, 25.0), (3, 32.0), (4, 40.0)):
        c.observe(k, ms / 1000)
    expected = c.seconds(2)
    c.observe(2, 1.3)
    assert c.observed[2] <= OUTLIER * expected                 # one sample counts at most this much
    assert c.seconds(2) <= c.seconds(3)                        # and never above a wider window
    assert c.best_window(0.9, hi=3) == 3 and c.speedup(2, 0.9) > c.speedup(1, 0.9)
    # a lasting change still gets through, a few samples later
    for _ in range(12):
        c.observe(4, 0.4)
    assert c.observed[4] == pytest.approx(0.4, rel=0.05)


def test_the_first_measurement_is_taken_as_it_is():
    c = CostModel(step_s=0.008)
    c.observe(0, 0.5)        # a slow machine, far from the prior: nothing to weigh it against
    assert c.seconds(0) == 0.5
