"""The draft model's catch-up pace (meshnode.spec.catchup): pure logic."""

from __future__ import annotations

import pytest

from meshnode.spec.catchup import FIRST_ROWS, MAX_ROWS, PROBE_EVERY, CatchUpPace


def test_pieces_halve_when_they_overrun_and_grow_by_a_quarter_when_they_fit():
    pace = CatchUpPace()
    assert pace.rows == FIRST_ROWS
    pace.piece_ended(overran=True)
    assert pace.rows == FIRST_ROWS // 2
    for _ in range(3):
        pace.piece_ended(overran=True)
    assert pace.rows == 1
    pace.piece_ended(overran=False)
    assert pace.rows == 2                    # (at least one more)
    for _ in range(100):
        pace.piece_ended(overran=False)
    assert pace.rows == MAX_ROWS


def test_once_even_one_row_outlasts_a_step_nothing_is_caught_up_but_a_probe_now_and_then():
    pace = CatchUpPace(first_rows=1)
    pace.piece_ended(overran=True)
    assert pace.rows == 0
    refusals = [pace.refusal(10, 1000, split=True, plain_s=None) for _ in range(PROBE_EVERY)]
    assert all(r is not None and "even one row" in r for r in refusals[:-1])
    assert refusals[-1] is None and pace.rows == 1        # the probe: a piece of one row
    pace.piece_ended(overran=False)
    assert pace.rows == 2


def test_on_a_split_a_context_is_caught_up_on_only_if_the_pieces_finish_before_the_answer():
    pace = CatchUpPace(first_rows=16)
    assert pace.refusal(16 * 96, 96, split=True, plain_s=None) is None
    why = pace.refusal(16 * 96 + 1, 96, split=True, plain_s=None)
    assert why is not None and "pieces of 16" in why and "96 steps left" in why


def test_on_one_node_a_catch_up_is_judged_by_its_measured_rate():
    pace = CatchUpPace()
    assert pace.refusal(10_000, 10, split=False, plain_s=0.02) is None     # rate not known yet: try
    pace.caught_up(4, 1.0)                   # a few rows measure per-call costs, not a rate
    assert pace.row_s is None
    pace.caught_up(1000, 3.5)                # 3.5 ms a row (a draft as big as the target, a CPU)
    assert pace.row_s == pytest.approx(0.0035)
    # 1000 tokens cost 3.5 s; half of 96 tokens at 20 ms is 0.96 s: not worth it
    why = pace.refusal(1000, 96, split=False, plain_s=0.02)
    assert why is not None and "3.50 ms each" in why
    assert pace.refusal(200, 96, split=False, plain_s=0.02) is None         # 0.7 s: worth it
    pace.caught_up(1000, 0.5)                # the rate follows what is measured (EWMA)
    assert pace.row_s == pytest.approx(0.0035 + 0.25 * (0.0005 - 0.0035))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        CatchUpPace(first_rows=0)
    with pytest.raises(ValueError):
        CatchUpPace(one_node_share=0)
