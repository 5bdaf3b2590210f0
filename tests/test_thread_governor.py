"""The thread governor's decisions (pure logic: a model of a machine stands in for
llama.cpp; tests/test_engine_threads.py runs the real engine)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.engine.threads import MAX_INTERVAL, TRIAL_CALLS, ThreadGovernor


def machine(cores: int, busy: int, one_thread_s: float = 0.020):
    """Seconds of a call with n threads on ``cores`` cores of which ``busy`` run another
    process: work divides over the threads, and threads beyond the free cores wait for a
    share of a busy core at every barrier (slower the more of them there are)."""
    free = max(1, cores - busy)

    def seconds(n: int) -> float:
        base = one_thread_s / n
        return base if n <= free else base * (1 + 3 * (n - free))
    return seconds


def cliff(cores: int, busy: int, one_thread_s: float = 0.020):
    """As measured on a 16-core host beside 4 busy processes: every count above the free
    cores is about as slow (15 threads as slow as 16), 2-3x a count that fits."""
    free = max(1, cores - busy)

    def seconds(n: int) -> float:
        return one_thread_s / n if n <= free else 2.6 * one_thread_s / free * (1 + 0.01 * (n - free))
    return seconds


def run(gov: ThreadGovernor, seconds, calls: int, rows: int = 1) -> list[int]:
    used = []
    for _ in range(calls):
        n = gov.threads_for(rows)
        used.append(n)
        gov.observe(rows, seconds(n), n)
    return used


def test_an_idle_machine_keeps_every_thread_and_tries_ever_more_rarely():
    gov = ThreadGovernor(8)
    used = run(gov, machine(8, 0), 4000)
    assert gov.threads == 8 and gov.changes == 0
    tries = sum(1 for n in used if n != 8)
    # tries doubling up to MAX_INTERVAL: a few percent of calls at the start, then < 1%
    assert tries <= TRIAL_CALLS * (4000 // MAX_INTERVAL + 6)
    late = used[2000:]
    assert sum(1 for n in late if n != 8) <= TRIAL_CALLS * (2000 // MAX_INTERVAL + 1)


@pytest.mark.parametrize("model", [machine, cliff])
@pytest.mark.parametrize("cores,busy", [(2, 1), (8, 3), (16, 4), (16, 8), (16, 13)])
def test_a_busy_machine_leads_to_the_free_cores(model, cores, busy):
    gov = ThreadGovernor(cores)
    used = run(gov, model(cores, busy), 3000)
    assert gov.threads == cores - busy
    assert used[-500:].count(cores - busy) >= 480       # and it stays there


def test_the_count_comes_back_when_the_machine_is_free_again():
    gov = ThreadGovernor(4)
    run(gov, machine(4, 2), 2000)
    assert gov.threads == 2
    run(gov, machine(4, 0), 4000)
    assert gov.threads == 4


def test_a_machine_getting_busy_is_noticed_soon_even_after_long_quiet():
    gov = ThreadGovernor(4)
    run(gov, machine(4, 0), 5000)        # tries now MAX_INTERVAL apart
    assert gov.threads == 4
    used = run(gov, cliff(4, 1), 400)
    # found within a few hundred calls (not MAX_INTERVAL per try), then kept
    assert gov.threads == 3 and used[-100:].count(3) >= 90


def test_calls_of_other_shapes_are_not_compared():
    """A prefill chunk between decode steps neither counts as a decode step nor breaks a
    try, and runs at the settled count: a try runs calls of one shape only."""
    gov = ThreadGovernor(2)
    sec = machine(2, 1)
    big = []
    for i in range(3000):
        rows = 64 if i % 5 == 4 else 1       # a big call, much slower than a step
        n = gov.threads_for(rows)
        if rows == 64:
            big.append((n, gov.threads))
        gov.observe(rows, (40 if rows == 64 else 1) * sec(n), n)
    assert gov.threads == 1
    assert all(n == settled for n, settled in big)


def test_one_thread_has_nothing_to_try():
    gov = ThreadGovernor(1)
    assert set(run(gov, machine(4, 3), 500)) == {1}


def test_a_count_must_be_positive():
    with pytest.raises(ValueError):
        ThreadGovernor(0)


@settings(max_examples=200, deadline=None)
@given(most=st.integers(1, 64),
       calls=st.lists(st.tuples(st.integers(1, 300), st.floats(0, 10, allow_nan=False)), max_size=400))
def test_the_count_stays_within_one_and_the_configured(most, calls):
    gov = ThreadGovernor(most)
    for rows, seconds in calls:
        n = gov.threads_for(rows)
        assert 1 <= n <= most
        gov.observe(rows, seconds, n)
        assert 1 <= gov.threads <= most


@pytest.mark.parametrize("cores,busy,model", [(16, 0, machine), (16, 4, cliff), (2, 1, machine)])
def test_noisy_calls_cost_little(cores, busy, model):
    """Calls that vary by +-20% at random: the counts chosen stay within a few percent of
    the best count's speed."""
    import random

    rng = random.Random(7)
    exact = model(cores, busy)
    gov = ThreadGovernor(cores)
    used = run(gov, lambda n: exact(n) * rng.uniform(0.8, 1.2), 6000)
    spent = sum(exact(n) for n in used[1000:])
    assert spent <= 1.04 * len(used[1000:]) * exact(cores - busy)
