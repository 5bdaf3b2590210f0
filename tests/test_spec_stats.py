"""SpecTelemetry counters and SpecStats snapshots."""

from __future__ import annotations

import pytest

from meshnode.spec.stats import DraftRecord, SpecCounters, SpecTelemetry
from meshnode.state import SpecState, SpecStats


def test_counters_per_request_and_overall():
    t = SpecTelemetry("ngram", recent=2)
    t.record_prompt("a", 100, 0.050)
    t.record_window("a", [1, 2, 3, 4], 3, 9, 0.020)
    t.record_window("a", [5, 6], 0, 7, 0.010)
    t.record_plain("a", 0.008)
    t.record_prompt("b", 10, 0.010)
    rec = t.record_window("b", [8], 1, 2, 0.012)
    t.record_lookahead("a", True)
    t.record_lookahead("a", False)
    t.record_lookahead("b", True)
    t.set_state(SpecState.ENABLED)
    t.set_window(6)

    assert rec == DraftRecord("b", (8,), 1, 2, pytest.approx(12.0))
    assert [r.request_id for r in t.recent()] == ["a", "b"]  # bounded to 2

    a = t.request_stats("a")
    assert a == SpecStats("ngram", SpecState.ENABLED, 6, 3, 2, 6, pytest.approx(15.0), 2, 1)
    assert a.acceptance == pytest.approx(0.5)
    total = t.snapshot()
    assert (total.proposed, total.accepted, total.windows) == (7, 4, 3)
    assert (total.lookahead, total.lookahead_used) == (3, 2)
    c = t.counters("a")
    assert c.rejected == 3 and c.plain_steps == 1 and c.predicted_n == 4 + 1 + 1

    assert (c.prompt_n, c.prompt_s) == (100, pytest.approx(0.05))
    assert c.predicted_n == 6 and c.predicted_s == pytest.approx(0.038)
    assert (c.proposed, c.accepted, c.windows) == (6, 3, 2)
    assert t.counters().proposed == 7

    final = t.end_request("a")
    assert final == c
    assert t.request_stats("a").proposed == 0
    assert t.snapshot().proposed == 7  # overall survives the request


def test_plain_steps_only():
    t = SpecTelemetry("none", state=SpecState.OFF)
    t.record_prompt("r", 5, 0.0)
    t.record_plain("r", 0.01)
    c = t.counters("r")
    assert (c.plain_steps, c.predicted_n, c.proposed, c.windows) == (1, 1, 0, 0)
    assert c.acceptance == 0.0 and c.verify_ms_mean == 0.0
    assert t.end_request("unknown") == SpecCounters()


def test_bad_window_rejected():
    with pytest.raises(ValueError):
        SpecTelemetry("ngram").record_window("r", [1], 2, 0, 0.0)


def test_step_costs_read_as_plain_then_drafts():
    from meshnode.state import format_step_costs

    assert format_step_costs(((0, 15.24), (1, 16.8), (3, 19.5))) == "plain 15.2, 1: 16.8, 3: 19.5 ms"
    assert format_step_costs([[2, 20.0]]) == "2: 20.0 ms"     # as /status's JSON gives them
    assert format_step_costs(()) == "-"
