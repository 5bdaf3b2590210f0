"""The prefix cache's decisions (pure logic): longest match, bounds, LRU, pins, epochs."""

from __future__ import annotations

import numpy as np

from meshnode.mesh.logprobs import TokenLogprobs
from meshnode.serve.prefix_cache import MIN_PREFIX, PrefixCache, common_prefix

FILE = list(range(1000, 1100))          # 100 tokens: "the file"


def test_common_prefix():
    a = np.arange(10, dtype=np.int32)
    assert common_prefix(a, a) == 10
    assert common_prefix(a, a[:4]) == 4
    b = a.copy()
    b[6] = -1
    assert common_prefix(a, b) == 6
    assert common_prefix(a, np.array([], dtype=np.int32)) == 0


def test_longest_match_wins_and_leaves_one_token_to_prefill():
    c = PrefixCache(3)
    assert c.put(1, FILE[:50] + [7] * 10, 0) == []
    assert c.put(2, FILE + [8, 9], 0) == []
    hit = c.lookup(FILE + [5, 6], 0)
    assert hit is not None and hit[0].session == 2 and hit[1] == 100
    c.unpin(hit[0])
    # the whole prompt is retained: all but its last token are reused
    e, n = c.lookup(FILE, 0)
    assert e.session == 2 and n == len(FILE) - 1


def test_too_short_a_match_is_a_miss():
    c = PrefixCache(3)
    c.put(1, FILE, 0)
    assert c.lookup(FILE[:MIN_PREFIX - 1] + [1, 2, 3], 0) is None
    assert c.lookup([5] * 200, 0) is None
    assert c.stats.lookups == 2 and c.stats.hits == 0


def test_capacity_bounds_the_sessions_and_evicts_least_recently_used():
    c = PrefixCache(2)
    prompts = {s: [s] * 40 for s in (1, 2, 3)}
    c.put(1, prompts[1], 0)
    c.put(2, prompts[2], 0)
    e, _ = c.lookup(prompts[1] + [0], 0)    # 1 is used: 2 becomes the oldest
    c.unpin(e)
    freed = c.put(3, prompts[3], 0)
    assert [f.session for f in freed] == [2] and freed[0].removed
    assert sorted(c.sessions()) == [1, 3] and len(c) == 2


def test_a_pinned_entry_is_never_evicted():
    c = PrefixCache(1)
    c.put(1, FILE, 0)
    e, _ = c.lookup(FILE + [1], 0)
    assert c.evict_one() is None
    # no room for another one while it is copied from: the new one is handed back
    freed = c.put(2, [9] * 40, 0)
    assert [f.session for f in freed] == [2] and c.sessions() == [1]
    c.unpin(e)
    assert c.evict_one().session == 1 and len(c) == 0


def test_evict_one_keeps_the_entry_a_request_copies_from():
    c = PrefixCache(3)
    c.put(1, [1] * 40, 0)
    c.put(2, [2] * 40, 0)
    keep, _ = c.lookup([1] * 41, 0)
    c.unpin(keep)
    assert c.evict_one(keep).session == 2
    assert c.evict_one(keep) is None


def test_an_entry_made_useless_by_a_longer_one_is_freed():
    c = PrefixCache(3)
    c.put(1, FILE[:60], 0)
    freed = c.put(2, FILE + [3, 4], 0)       # a later turn of the same conversation
    assert [f.session for f in freed] == [1] and c.sessions() == [2]
    # a different continuation keeps both
    assert c.put(3, FILE[:80] + [7] * 5, 0) == []
    assert sorted(c.sessions()) == [2, 3]


def test_short_sequences_and_capacity_zero_are_not_kept():
    assert [f.session for f in PrefixCache(3).put(1, [1] * (MIN_PREFIX - 1), 0)] == [1]
    off = PrefixCache(0)
    assert [f.session for f in off.put(1, FILE, 0)] == [1]
    assert off.lookup(FILE, 0) is None and off.stats.lookups == 0


def test_entries_of_another_route_are_never_matched_and_dropped_when_stale():
    c = PrefixCache(3)
    c.put(1, FILE, 0)
    assert c.lookup(FILE + [1], 1) is None
    c.put(2, FILE[:50] + [4] * 3, 1)
    stale = c.drop_stale(1)
    assert [e.session for e in stale] == [1] and c.sessions() == [2]


def test_telemetry_counts_hits_and_tokens_reused():
    c = PrefixCache(2)
    c.put(1, FILE, 0)
    e, n = c.lookup(FILE + [1, 2], 0)
    c.used(e, n)
    c.unpin(e)
    assert c.stats.as_dict() == {"lookups": 1, "hits": 1, "tokens_reused": 100, "retained": 1, "evicted": 0,
                                 "taken": 0}
    assert len(c.clear()) == 1 and c.stats.evicted == 1


def test_a_taken_entry_leaves_without_being_freed():
    c = PrefixCache(2)
    c.put(1, FILE, 0)
    c.put(2, [7] * 40, 0)
    e, n = c.lookup(FILE + [1], 0)
    c.take(e)
    assert e.removed and c.sessions() == [2] and c.lookup(FILE + [1], 0) is None
    assert c.stats.taken == 1 and c.stats.evicted == 0


def _scores(n: int, top: int) -> TokenLogprobs:
    """Scores of tokens 1..n with ``top`` alternatives each (values: the token's position)."""
    return TokenLogprobs(tuple(float(-i) for i in range(1, n + 1)), tuple(range(n * top)),
                         tuple(float(-i) for i in range(n * top)))


def test_a_scored_prompt_matches_only_entries_with_enough_scores():
    c = PrefixCache(3)
    c.put(1, FILE + [1, 2], 0)                               # generated text: no scores
    assert c.lookup(FILE + [5], 0, scored=2) is None
    c.put(2, FILE[:60] + [7], 0, _scores(60, 1), 1)          # one alternative each
    assert c.lookup(FILE + [5], 0, scored=2) is None
    c.put(3, FILE[:80] + [8], 0, _scores(80, 2), 2)
    e, n = c.lookup(FILE + [5], 0, scored=2)
    # 80 tokens shared: position 79's score is the entry's own, so 79 positions come over
    assert e.session == 3 and n == 79
    c.unpin(e)
    # a plain prompt takes any entry, as far as it shares the tokens
    e, n = c.lookup(FILE + [5], 0)
    assert e.session == 1 and n == len(FILE)
    c.unpin(e)


def test_a_scored_match_stops_at_the_entrys_scores():
    c = PrefixCache(3)
    # the entry's KV holds 100 tokens, its scores only its 40-token prompt's (tokens 1..39)
    c.put(1, FILE, 0, _scores(39, 0), 0)
    e, n = c.lookup(FILE + [5], 0, scored=0)
    assert n == 39


def test_an_entry_with_scores_is_not_made_useless_by_one_without():
    c = PrefixCache(3)
    c.put(1, FILE[:50], 0, _scores(49, 2), 2)
    assert c.put(2, FILE, 0) == []                           # no scores: both kept
    assert sorted(c.sessions()) == [1, 2]
    freed = c.put(3, FILE + [4], 0, _scores(100, 2), 2)      # covers both
    assert sorted(f.session for f in freed) == [1, 2]
