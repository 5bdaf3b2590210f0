"""NGramProposer: prompt-lookup proposals, incremental index, would-hit checks."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.spec.ngram import NGramDrafter, NGramProposer


def reference_propose(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Brute force: longest suffix n-gram, latest earlier occurrence, periodic extension."""
    size = len(tokens)
    for n in range(min(max_n, size), min_n - 1, -1):
        suffix = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):  # occurrence must end before the suffix does
            if tokens[start : start + n] == suffix:
                ext = list(tokens)
                for j in range(k):
                    ext.append(ext[start + n + j])
                return ext[size:]
    return []


def test_continues_latest_earlier_occurrence():
    p = NGramProposer([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], max_n=3)
    # latest earlier "1 2 3" is at positions 4..6, followed by 7 5
    assert p.propose(2) == [7, 5]
    assert p.match() == (3, 7)


def test_prefers_longer_ngrams():
    # "3" alone was last followed by 8, but "2 3" by 4
    p = NGramProposer([2, 3, 4, 5, 3, 8, 6, 2, 3], max_n=3)
    assert p.propose(2) == [4, 5]


def test_a_longer_context_picks_the_passage_being_copied():
    # "1 2 3 4" occurs twice; the context before the current one ("6") only agrees with
    # the first occurrence, so up to max_n 12 that one is continued, not the latest
    toks = [5, 6, 1, 2, 3, 4, 30, 31, 9, 8, 1, 2, 3, 4, 40, 41, 7, 6, 1, 2, 3, 4]
    assert NGramProposer(toks, max_n=4).propose(2) == [40, 41]
    assert NGramProposer(toks, max_n=12).propose(2) == [30, 31]
    assert NGramProposer(toks, max_n=12).match() == (5, 6)


def test_only_the_latest_candidates_are_compared():
    # a 4-gram seen more than MAX_CANDIDATES times: the lookup stays bounded and still
    # answers from the latest occurrences
    from meshnode.spec.ngram import MAX_CANDIDATES

    toks = [1, 2, 3, 4, 9] * (3 * MAX_CANDIDATES) + [1, 2, 3, 4]
    p = NGramProposer(toks, max_n=12)
    n, start = p.match()
    assert n == 12 and toks[start] == 9


def test_no_match_and_k_zero():
    p = NGramProposer([1, 2, 3, 4], max_n=3)
    assert p.propose(4) == []
    assert p.would_hit(1) is None
    p.observe([1])
    assert p.propose(0) == []
    assert p.propose(3) == [2, 3, 4]


def test_periodic_extension_beyond_context():
    p = NGramProposer([5, 6, 5, 6], max_n=2)
    assert p.propose(5) == [5, 6, 5, 6, 5]
    q = NGramProposer([7, 7], max_n=3)
    assert q.propose(3) == [7, 7, 7]


def test_incremental_equals_batch_and_reset():
    toks = [random.Random(1).randrange(6) for _ in range(200)]
    a = NGramProposer(max_n=4)
    for t in toks:
        a.observe([t])
    b = NGramProposer(toks, max_n=4)
    assert a.propose(8) == b.propose(8)
    b.reset([1, 2, 1])
    assert len(b) == 3 and b.propose(2) == [2, 1]


def test_would_hit():
    p = NGramProposer([1, 2, 3, 1, 2], max_n=3)
    assert p.would_hit(3) is True
    assert p.would_hit(4) is False


def test_drafter_protocol_adapter():
    d = NGramDrafter(max_n=3)
    d.reset([1, 2, 3, 1])
    assert d.propose([1], 2) == [2, 3]
    d.accept([2, 3])
    assert d.propose([], 1) == [1]


def test_min_n_above_one():
    p = NGramProposer([1, 2, 9, 2], max_n=3, min_n=2)
    assert p.propose(2) == []  # only a 1-gram matches


@settings(max_examples=200, deadline=None)
@given(
    toks=st.lists(st.integers(0, 4), max_size=60),
    k=st.integers(0, 8),
    max_n=st.integers(1, 14),
)
def test_matches_brute_force(toks, k, max_n):
    p = NGramProposer(max_n=max_n)
    # feed in random-sized chunks to exercise incremental updates
    i = 0
    while i < len(toks):
        j = i + 1 + (toks[i] % 3)
        p.observe(toks[i:j])
        i = j
    expect = reference_propose(toks, k, max_n, 1) if k > 0 else []
    assert p.propose(k) == expect


@settings(max_examples=200, deadline=None)
@given(
    toks=st.lists(st.integers(0, 4), max_size=40),
    after=st.lists(st.integers(0, 4), max_size=6),
    k=st.integers(1, 6),
)
def test_propose_after_is_a_lookup_that_indexes_nothing(toks, after, k):
    # ``after`` continues the context for one lookup: drafts in flight. The match may
    # only point into the indexed context, so compare against the brute force over
    # toks + after restricted to occurrences that end before ``after`` starts.
    p = NGramProposer(toks, max_n=3)
    before = (p.propose(k), len(p))
    got = p.propose(k, after=after)
    assert (p.propose(k), len(p)) == before  # nothing was indexed
    ext = toks + after
    expect: list[int] = []
    for n in range(min(3, len(ext)), 0, -1):
        suffix = ext[len(ext) - n:]
        starts = [s for s in range(len(toks) - n, -1, -1) if toks[s:s + n] == suffix and s + n < len(toks)]
        if starts:
            start = starts[0] + n
            out = list(ext)
            for j in range(k):
                out.append(out[start + j])
            expect = out[len(ext):]
            break
    assert got == expect


def test_propose_after_guesses_past_the_drafts_in_flight():
    p = NGramProposer([1, 2, 3, 4, 5, 6, 7, 9, 1, 2], max_n=3)
    assert p.propose(2) == [3, 4]
    # drafts 3 4 in flight: what follows them is 5 6 ...
    assert p.propose(3, after=[3, 4]) == [5, 6, 7]
    assert p.propose(2, after=[8, 8]) == []


# ---- the copy cursor -------------------------------------------------------------

# A "file" of distinct tokens, as code mostly is at the scale of a few tokens.
SOURCE = list(range(100, 140))


def _copying(prompt: list[int], out: list[int]) -> NGramProposer:
    p = NGramProposer(prompt)
    p.observe(out)
    return p


def test_cursor_takes_a_copy_up_again_after_a_replaced_token():
    # the answer copies the file, renaming token 110 (one token) as 999 (not in the prompt)
    p = _copying(SOURCE, SOURCE[:10] + [999])
    assert p.propose(4, min_match=3) == []              # off the text: nothing to go by
    p.observe([111])                                     # one token could be chance
    assert p.propose(4, min_match=3) == []
    p.observe([112])
    # a 3-token match does not exist yet ([999, 111, 112]); the cursor knows the place
    assert p.propose(4, min_match=3) == [113, 114, 115, 116]
    assert p.would_hit(113, min_match=3) is True


def test_cursor_skips_a_replaced_span_and_an_insertion():
    # 110 111 112 replaced by one token: the output takes the file up at 113 114
    p = _copying(SOURCE, SOURCE[:10] + [999, 113, 114])
    assert p.propose(3, min_match=3) == [115, 116, 117]
    # too far on (more than RESYNC_SKIP past the output's gap): not taken up
    from meshnode.spec.ngram import RESYNC_SKIP

    far = 113 + RESYNC_SKIP
    assert _copying(SOURCE, SOURCE[:10] + [999, far, far + 1]).propose(3, min_match=3) == []
    # an inserted run of new tokens, then the file again where it left off
    q = _copying(SOURCE, SOURCE[:10] + [900, 901, 902, 903, 904, 110])
    assert q.propose(3, min_match=3) == [111, 112, 113]


def test_cursor_is_dropped_far_off_the_text():
    from meshnode.spec.ngram import CURSOR_MAX_GAP

    p = _copying(SOURCE, SOURCE[:10] + list(range(900, 901 + CURSOR_MAX_GAP)))
    p.observe([110])   # the file's next token, but the output has long left the file
    assert p.propose(3, min_match=3) == []


def test_cursor_follows_drafts_in_flight():
    p = _copying(SOURCE, SOURCE[:10] + [999, 111, 112])
    assert p.propose(2, min_match=3, after=[113, 114]) == [115, 116]
    assert p.propose(2, min_match=3, after=[998, 997]) == []   # they leave the text
    assert p.propose(2, min_match=3) == [113, 114]              # nothing was moved


def test_cursor_does_not_follow_the_prompt():
    # indexing the prompt places no cursor: only generated text is followed
    p = NGramProposer(SOURCE + [999, 111, 112])
    assert p.propose(2, min_match=3) == []


@settings(max_examples=200, deadline=None)
@given(out=st.lists(st.integers(0, 4), max_size=40), k=st.integers(1, 6), min_match=st.integers(1, 4))
def test_cursor_only_drafts_where_the_match_would_not(out, k, min_match):
    # a match of min_match tokens is followed as without a cursor; the cursor only adds
    # drafts where there were none, and they continue the context
    prompt = [random.Random(len(out)).randrange(5) for _ in range(30)]
    p = _copying(prompt, out)
    toks = prompt + out
    expect = reference_propose(toks, k, 12, min_match)
    got = p.propose(k, min_match=min_match)
    if expect:
        assert got == expect
    else:
        assert len(got) in (0, k)
