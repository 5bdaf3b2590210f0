"""AutoPolicy transitions and its measured cost gate."""

from __future__ import annotations

import logging
import random

import pytest

from meshnode.spec.ngram import NGramProposer
from meshnode.spec.cost_model import CostModel
from meshnode.spec.policy import AutoPolicy, AutoPolicyParams, prompt_affinity
from meshnode.state import SpecState

CODE_LIKE = [10, 11, 12, 13, 14, 15] * 20 + [1, 2, 3]
RANDOM = random.Random(7).sample(range(50_000), 200)


# ---- prompt affinity ----------------------------------------------------------


def test_affinity_scores():
    assert prompt_affinity(CODE_LIKE) > 0.8
    assert prompt_affinity(RANDOM) == 0.0
    assert prompt_affinity([1, 2]) == 0.0


# ---- auto policy ----------------------------------------------------------------


def test_enables_on_repetitive_prompt(caplog):
    seen = []
    pol = AutoPolicy(on_transition=lambda old, new, why: seen.append((old, new)))
    assert pol.state is SpecState.COLD and pol.should_observe
    with caplog.at_level(logging.INFO, logger="meshnode.spec.policy"):
        pol.on_prompt(CODE_LIKE)
    assert pol.state is SpecState.ENABLED and pol.should_draft
    assert seen == [(SpecState.COLD, SpecState.ENABLED)]
    assert "cold -> enabled" in caplog.text


def test_stays_cold_on_random_text():
    pol = AutoPolicy()
    pol.on_prompt(RANDOM)
    ng = NGramProposer(RANDOM, max_n=3)
    rng = random.Random(3)
    for _ in range(300):  # generate random tokens; the n-gram index rarely predicts them
        t = rng.randrange(50_000)
        pol.record_cold(ng.would_hit(t))
        ng.observe([t])
        pol.on_generated(1)
    assert pol.state is SpecState.COLD


def test_cold_hits_enable():
    pol = AutoPolicy()
    pol.on_prompt(RANDOM)
    for hit in (None, True, False, True, True):
        pol.record_cold(hit)
        assert pol.state is SpecState.COLD
    pol.record_cold(True)  # 4 hits of 5 counted observations
    assert pol.state is SpecState.ENABLED


def test_cold_would_hit_from_real_proposer_enables():
    prompt = RANDOM[:100]
    pol = AutoPolicy()
    pol.on_prompt(prompt)
    ng = NGramProposer(prompt, max_n=3)
    for t in RANDOM[40:60]:  # the model starts quoting the prompt
        pol.record_cold(ng.would_hit(t))
        ng.observe([t])
        if pol.should_draft:
            break
    assert pol.state is SpecState.ENABLED


def test_disables_below_threshold_then_cools_down_and_probes():
    p = AutoPolicyParams(cooldown_tokens=10, cooldown_growth=2.0, cooldown_max_tokens=25)
    pol = AutoPolicy(params=p)
    pol.on_prompt(CODE_LIKE)
    for i in range(7):
        pol.record_verify(4, 0)
        assert pol.state is SpecState.ENABLED, i  # not judged before 8 windows
    pol.record_verify(4, 0)
    assert pol.state is SpecState.COOLING_DOWN
    assert pol.cooldown_left == 10 and not pol.should_draft and not pol.should_observe
    pol.record_verify(4, 4)  # ignored while not enabled
    pol.on_generated(9)
    assert pol.state is SpecState.COOLING_DOWN
    pol.on_generated(1)
    assert pol.state is SpecState.COLD  # probing again
    # second failure: the cooldown doubles; third: capped
    for expect in (20, 25):
        for _ in range(4):
            pol.record_cold(True)
        assert pol.state is SpecState.ENABLED
        for _ in range(8):
            pol.record_verify(4, 1)  # per-token acceptance 1/2: still above 0.45
        assert pol.state is SpecState.ENABLED
        for _ in range(2):
            pol.record_verify(4, 0)  # 8/18 < 0.45
        assert pol.state is SpecState.COOLING_DOWN
        assert pol.cooldown_left == expect
        pol.on_generated(expect)
        assert pol.state is SpecState.COLD


def test_per_token_acceptance_keeps_good_long_windows():
    pol = AutoPolicy()
    pol.on_prompt(CODE_LIKE)
    # 3 of 8 accepted each time: accepted/proposed = 0.375, per token 3/4 = 0.75
    for _ in range(20):
        pol.record_verify(8, 3)
    assert pol.state is SpecState.ENABLED
    assert pol.acceptance == pytest.approx(0.75)


def test_healthy_stretch_forgives_failures():
    p = AutoPolicyParams(cooldown_tokens=10)
    pol = AutoPolicy(params=p)
    pol.on_prompt(CODE_LIKE)
    for _ in range(8):
        pol.record_verify(4, 0)
    assert pol.failures == 1
    pol.on_generated(10)
    pol.on_prompt(CODE_LIKE)
    for _ in range(16):
        pol.record_verify(4, 4)
    assert pol.failures == 0 and pol.state is SpecState.ENABLED


def test_new_prompt_without_affinity_returns_to_cold():
    pol = AutoPolicy()
    pol.on_prompt(CODE_LIKE)
    pol.on_prompt(RANDOM)
    assert pol.state is SpecState.COLD


def test_modes_on_and_off():
    on = AutoPolicy("on")
    assert on.state is SpecState.ENABLED
    for _ in range(50):
        on.record_verify(4, 0)
    assert on.state is SpecState.ENABLED
    off = AutoPolicy("off")
    off.on_prompt(CODE_LIKE)
    off.record_cold(True)
    assert off.state is SpecState.OFF and not off.should_draft
    with pytest.raises(ValueError):
        AutoPolicy("sometimes")  # type: ignore[arg-type]


def test_record_verify_rejects_bad_counts():
    pol = AutoPolicy("on")
    with pytest.raises(ValueError):
        pol.record_verify(2, 3)


# ---- the measured cost gate -----------------------------------------------------------


def _route(plain_s: float, per_draft_s: float) -> CostModel:
    cost = CostModel()
    cost.observe(0, plain_s)
    for k in (1, 2, 4):
        cost.observe(k, plain_s + per_draft_s * k)
    return cost


def _judged(cost: CostModel | None, accepted_of_two: list[int]) -> SpecState:
    policy = AutoPolicy("auto", cost=cost)
    policy.on_prompt(CODE_LIKE)                # affinity: enabled at once
    for acc in accepted_of_two:
        policy.record_verify(2, acc)
    return policy.state


# 0.5 per-token acceptance: windows of two drafts that keep one each
ACC_0_5 = [1] * 10


def test_costly_verify_rows_switch_drafting_off_at_middling_acceptance():
    # every draft row costs 0.4 of a plain step (one CPU thread, small model): 0.6 does not pay
    assert _judged(_route(0.040, 0.016), ACC_0_5) is SpecState.COOLING_DOWN


def test_cheap_verify_rows_keep_drafting_at_the_same_acceptance():
    # rows nearly free (memory-bound or latency-bound route): the same acceptance pays
    assert _judged(_route(0.040, 0.002), ACC_0_5) is SpecState.ENABLED
    # and with no measurements yet only the fixed floor judges
    assert _judged(None, ACC_0_5) is SpecState.ENABLED
    assert _judged(CostModel(), ACC_0_5) is SpecState.ENABLED


def test_the_cost_gate_never_overrides_the_floor():
    # free rows, but acceptance under 0.45 still backs off
    assert _judged(_route(0.040, 0.0), [0, 1, 0, 0, 1, 0, 0, 1, 0, 0]) is SpecState.COOLING_DOWN


# ---- the realized gate: what drafting did, not what the model expects ------------------


def _judged_timed(cost: CostModel, windows: list[tuple[int, int, float]]) -> AutoPolicy:
    policy = AutoPolicy("auto", cost=cost)
    policy.on_prompt(CODE_LIKE)                # affinity: enabled at once
    for proposed, accepted, seconds in windows:
        policy.record_verify(proposed, accepted, seconds)
    return policy


def test_realized_gain_keeps_windows_the_model_would_refuse():
    # Each draft row costs 0.65 of a plain step (Q4_1 on one CPU thread): at acceptance
    # 0.8 the geometric model expects < 1.1x from any window. But half of these windows
    # were lookaheads that overlapped the window before them (a copy run), so drafting
    # yielded 24 tokens in the time of 14 plain steps.
    cost = _route(0.040, 0.026)
    windows = [(3, 3, 0.045), (3, 1, 0.095)] * 4
    policy = _judged_timed(cost, windows)
    assert policy.acceptance == pytest.approx(0.8)
    assert cost.speedup(cost.best_window(0.8), 0.8) < 1.10       # what the model expects
    assert policy.realized_gain == pytest.approx(24 * 0.040 / (4 * 0.045 + 4 * 0.095))
    assert policy.state is SpecState.ENABLED


def test_realized_gain_switches_off_windows_that_did_not_pay():
    # Acceptance above the floor, rows nearly free by the model, but the windows took
    # as long as the tokens they yielded would have taken plainly.
    cost = _route(0.040, 0.002)
    policy = _judged_timed(cost, [(2, 1, 0.080)] * 8)   # 2 tokens per 2 plain steps' time
    assert policy.realized_gain == pytest.approx(1.0)
    assert policy.state is SpecState.COOLING_DOWN


def test_realized_gain_needs_measured_plain_steps_and_every_window_timed():
    assert _judged_timed(CostModel(), [(2, 2, 0.05)] * 3).realized_gain is None
    cost = _route(0.040, 0.010)
    pol = AutoPolicy("auto", cost=cost)
    pol.on_prompt(CODE_LIKE)
    pol.record_verify(2, 2, 0.05)
    pol.record_verify(2, 2)             # untimed: the model-based gate judges instead
    assert pol.realized_gain is None
    with pytest.raises(ValueError):
        pol.record_verify(2, 1, -1.0)


def test_a_proposer_that_cannot_be_observed_probes_by_drafting():
    # A draft model costs a forward pass per guess, so auto mode has no cold phase for it:
    # it starts drafting, is judged like n-gram drafting, and probes again by drafting.
    cost = _route(0.040, 0.030)
    pol = AutoPolicy("auto", AutoPolicyParams(cooldown_tokens=10), cost=cost, observes=False)
    assert pol.state is SpecState.ENABLED and not pol.should_observe
    pol.on_prompt([1, 2, 3, 4] * 20)                 # prompt shape says nothing about a draft
    assert pol.state is SpecState.ENABLED
    for _ in range(8):
        pol.record_verify(3, 2, 0.140)               # 3 tokens in 3.5 plain steps' time
    assert pol.state is SpecState.COOLING_DOWN
    pol.on_prompt([1, 2, 3, 4] * 20)
    assert pol.state is SpecState.COOLING_DOWN      # a new prompt is no reason to probe
    pol.on_generated(10)
    assert pol.state is SpecState.ENABLED and pol.should_draft


def test_a_draft_models_auto_policy_measures_plain_steps_before_its_first_window():
    """Drafting at every step would leave no plain step to judge the draft's windows
    against (only the acceptance floor): a fresh route decodes a few tokens plainly first."""
    from meshnode.spec.cost_model import CostModel

    cost = CostModel()
    reasons: list[str] = []
    pol = AutoPolicy("auto", AutoPolicyParams(measure_tokens=4, cooldown_tokens=10), cost=cost, observes=False,
                     on_transition=lambda old, new, why: reasons.append(why))
    assert pol.state is SpecState.COOLING_DOWN and not pol.should_draft and pol.cooldown_left == 4
    for _ in range(4):
        cost.observe(0, 0.020)          # the plain steps, as the decoder measures them
        pol.on_generated(1)
    assert pol.state is SpecState.ENABLED
    for _ in range(8):
        pol.record_verify(1, 1, 0.043)  # 2 tokens in 2.15 plain steps' time: it loses
    assert pol.state is SpecState.COOLING_DOWN and "ran at 0.93x" in reasons[-1], reasons
    # measured already, or pinned on: drafting from the first step
    assert AutoPolicy("auto", cost=cost, observes=False).state is SpecState.ENABLED
    assert AutoPolicy("on", cost=CostModel(), observes=False).state is SpecState.ENABLED
