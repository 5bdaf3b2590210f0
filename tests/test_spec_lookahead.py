"""LookaheadGate: when stage 0 sends the next verify window before this one returns."""

from __future__ import annotations

from meshnode.spec.lookahead import LookaheadGate, LookaheadParams


def test_only_after_a_fully_accepted_window():
    g = LookaheadGate()
    assert not g.allow()                  # nothing verified yet
    g.window_done(4, 4)
    assert g.allow()
    g.window_done(4, 3)                   # cut short: the proposer lost the run
    assert not g.allow()
    g.window_done(0, 0)                   # a plain step
    assert not g.allow()


def test_closes_when_guesses_fail_and_probes_to_reopen():
    p = LookaheadParams(initial=0.7, min_rate=0.5, ewma=0.5, probe_every=4)
    g = LookaheadGate(p)
    g.window_done(3, 3)
    g.outcome(False)
    g.outcome(False)                      # 0.7 -> 0.35 -> 0.175
    assert g.rate < p.min_rate
    allowed = [g.allow() for _ in range(8)]
    assert allowed == [False, False, False, True] * 2   # one probe per probe_every
    g.outcome(True)
    g.outcome(True)                       # 0.175 -> 0.59 -> 0.79
    assert g.allow() and g.allow()
    assert (g.sent, g.used) == (4, 2)


def test_defaults_keep_guessing_at_a_quarter_hit_rate():
    # a wrong guess costs a few ms, a right one saves ~30 (module doc): stay open at 0.3
    g = LookaheadGate()
    g.window_done(2, 2)
    for _ in range(40):
        for used in (True, False, False):
            g.outcome(used)
    assert 0.25 < g.rate < 0.45 and g.allow()
