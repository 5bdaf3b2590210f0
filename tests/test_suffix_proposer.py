"""The recent-texts proposer (meshnode.spec.suffix): the automaton finds the longest
earlier substring, drafts come from a recent request of the same client, memory stays
bounded and old texts are evicted. Pure logic, fake clock."""

from __future__ import annotations

import random

import pytest
from starlette.requests import Request

from meshnode.serve.openai_routes import _caller   # imported at collection (ifaddr runs ldconfig)
from meshnode.spec.ngram import NGramProposer
from meshnode.spec.suffix import RecentTexts, SuffixAutomaton, SuffixProposer


def _longest_occurring_suffix(text: list[int], stream: list[int]) -> int:
    """Brute force: the longest suffix of ``stream`` that is a substring of ``text``."""
    best = 0
    for n in range(1, len(stream) + 1):
        suffix = stream[len(stream) - n:]
        if any(text[i:i + n] == suffix for i in range(len(text) - n + 1)):
            best = n
    return best


def test_automaton_matches_brute_force_and_stays_linear():
    rng = random.Random(7)
    text = [rng.randrange(4) for _ in range(300)]
    sam = SuffixAutomaton(text)
    assert sam.n_states <= 2 * len(text)
    state = length = 0
    stream: list[int] = []
    for _ in range(200):
        t = rng.randrange(5)   # 4 never occurs in the text: resets the match
        stream.append(t)
        state, length = sam.walk(state, length, t)
        assert length == _longest_occurring_suffix(text, stream[-40:]) or length >= 40
        if length:
            # the continuation follows an occurrence of the matched suffix
            end = sam._end[state]
            assert text[end - length + 1:end + 1] == stream[len(stream) - length:]


def test_drafts_an_edit_from_the_same_clients_previous_answer():
    # request 1 answered with a renamed file; request 2 sends the file (a little changed)
    # again: its prompt has the old names, the previous answer has the new ones
    old = list(range(100, 160))
    renamed = [t if t % 7 else t + 1000 for t in old]
    recent = RecentTexts()
    recent.add("key:a", [1, 2, 3, *old, 4, *renamed], now=0.0)
    prompt = [1, 2, 3, *old[:30], 999, *old[30:], 4]
    p = SuffixProposer(prompt, recent.automaton("key:a", now=10.0))
    plain = NGramProposer(prompt)
    p.observe(renamed[:8])
    plain.observe(renamed[:8])
    want = renamed[8:16]
    assert p.propose(8, min_match=3) == want
    assert plain.propose(8, min_match=3) != want   # the prompt alone guesses the old names
    # another client sees nothing of it
    assert recent.automaton("key:b", now=10.0) is None
    assert p.would_hit(renamed[8], min_match=3) is True


def test_the_context_wins_when_it_matches_as_long_and_lookahead_after_works():
    recent = RecentTexts()
    recent.add("c", [5, 6, 7, 8, 9, 10, 11, 12, 40, 41], now=0.0)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 50, 51, 52]
    p = SuffixProposer(prompt, recent.automaton("c", now=0.0), history_min=3)
    p.observe([5, 6, 7, 8, 9, 10, 11, 12])
    assert p.propose(2, min_match=3) == [50, 51]       # same length: the request's own text
    q = SuffixProposer([1, 2], recent.automaton("c", now=0.0), history_min=3)
    q.observe([5, 6, 7])
    assert q.propose(3, min_match=3) == [8, 9, 10]
    assert q.propose(3, min_match=3, after=[8, 9]) == [10, 11, 12]
    assert len(q) == 5                                  # `after` was not indexed
    # a continuation stops at the end of its text (the separator)
    assert q.propose(9, min_match=3, after=[8, 9, 10, 11, 12, 40]) == [41]


def test_bounded_memory_and_eviction_by_size_age_and_clients():
    recent = RecentTexts(max_clients=2, max_tokens=100, max_texts=3, max_age_s=60.0)
    for i in range(5):
        recent.add("a", [i] * 30, now=float(i))
    assert recent.total_tokens <= 90                  # 3 texts at most for a client
    recent.add("b", list(range(60)), now=5.0)
    assert recent.total_tokens <= 100                 # a's oldest texts went first
    sam = recent.automaton("b", now=5.0)
    assert sam is not None and sam.n_states <= 2 * (len(sam) + 1)
    recent.add("c", [1, 2, 3], now=6.0)
    assert len(recent.clients()) == 2 and "c" in recent.clients()
    assert recent.automaton("c", now=6.0 + 61.0) is None   # too old: forgotten
    assert recent.clients() == []


def test_no_history_is_the_ngram_proposer():
    rng = random.Random(3)
    prompt = [rng.randrange(20) for _ in range(200)]
    a, b = SuffixProposer(prompt), NGramProposer(prompt)
    for _ in range(100):
        t = rng.randrange(20)
        assert a.propose(5, min_match=3) == b.propose(5, min_match=3)
        a.observe([t])
        b.observe([t])


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        RecentTexts(max_tokens=0)


def test_a_client_is_its_address_and_a_hash_of_its_key():
    def req(host, auth=None):
        headers = [(b"authorization", auth.encode())] if auth else []
        return Request({"type": "http", "method": "POST", "path": "/", "headers": headers,
                        "client": (host, 5000)})

    assert _caller(req("10.0.0.5")) == "10.0.0.5"
    a, b = _caller(req("10.0.0.5", "Bearer k1")), _caller(req("10.0.0.5", "Bearer k2"))
    assert a != b and a.startswith("10.0.0.5/") and "k1" not in a
    assert _caller(req("10.0.0.6", "Bearer k1")) != a      # one shared key, two callers
    assert _caller(req("10.0.0.5", "bearer k1")) == a
