"""SpecTelemetry counters, SpecStats snapshots and llama.cpp-style timings."""

from __future__ import annotations

import pytest

from meshnode.spec.stats import DraftRecord, SpecTelemetry
from meshnode.state import SpecState, SpecStats


def test_counters_per_request_and_overall():
    t = SpecTelemetry("ngram", recent=2)
    t.record_prompt("a", 100, 0.050)
    t.record_window("a", [1, 2, 3, 4], 3, 9, 0.020)
    t.record_window("a", [5, 6], 0, 7, 0.010)
    t.record_plain("a", 0.008)
    t.record_prompt("b", 10, 0.010)
    rec = t.record_window("b", [8], 1, 2, 0.012)
    t.set_state(SpecState.ENABLED)
    t.set_window(6)

    assert rec == DraftRecord("b", (8,), 1, 2, pytest.approx(12.0))
    assert [r.request_id for r in t.recent()] == ["a", "b"]  # bounded to 2

    a = t.request_stats("a")
    assert a == SpecStats("ngram", SpecState.ENABLED, 6, 3, 2, 6, pytest.approx(15.0))
    assert a.acceptance == pytest.approx(0.5)
    total = t.snapshot()
    assert (total.proposed, total.accepted, total.windows) == (7, 4, 3)
    c = t.counters("a")
    assert c.rejected == 3 and c.plain_steps == 1 and c.predicted_n == 4 + 1 + 1

    tm = t.timings("a")
    assert tm["prompt_n"] == 100 and tm["prompt_ms"] == pytest.approx(50.0)
    assert tm["predicted_n"] == 6 and tm["predicted_ms"] == pytest.approx(38.0)
    assert tm["predicted_per_second"] == pytest.approx(6 / 0.038)
    assert tm["draft_n"] == 6 and tm["draft_n_accepted"] == 3
    assert t.timings()["draft_n"] == 7

    final = t.end_request("a")
    assert final == tm
    assert t.request_stats("a").proposed == 0
    assert t.snapshot().proposed == 7  # overall survives the request


def test_timings_without_drafts_omit_draft_fields():
    t = SpecTelemetry("none", state=SpecState.OFF)
    t.record_prompt("r", 5, 0.0)
    t.record_plain("r", 0.01)
    tm = t.timings("r")
    assert "draft_n" not in tm and tm["prompt_per_second"] == 0.0
    assert tm["predicted_per_second"] == pytest.approx(100.0)
    assert t.end_request("unknown")["predicted_n"] == 0


def test_bad_window_rejected():
    with pytest.raises(ValueError):
        SpecTelemetry("ngram").record_window("r", [1], 2, 0, 0.0)
