"""ActiveRequest (meshnode.serve.request): a step's tokens -> text deltas and the end of
the request, without a model server."""

from __future__ import annotations

from meshnode.serve.client import StopMatcher
from meshnode.mesh.final import GREEDY
from meshnode.serve.request import ActiveRequest
from meshnode.state import RequestInfo, RequestStatus

EOG = 0
SPLIT = {1: b"\xc3", 2: b"\xa9"}   # two tokens that together make "é"


class ByteTokenizer:
    eog_ids = frozenset({EOG})

    def decode_bytes(self, tokens: list[int]) -> bytes:
        return b"".join(SPLIT.get(t, bytes([t])) for t in tokens)


def _req(max_tokens: int = 100, stops: tuple[str, ...] = ()) -> ActiveRequest:
    info = RequestInfo("r", "m", RequestStatus.QUEUED, 3, 0, 0.0, None, 0.0)
    return ActiveRequest("r", 1, [5, 6, 7], GREEDY, max_tokens, StopMatcher(stops), info)


def _text(deltas) -> str:
    return "".join(d.text for d in deltas)


def test_tokens_become_text_and_max_tokens_ends_with_length() -> None:
    r, tok = _req(max_tokens=4), ByteTokenizer()
    assert _text(r.take(list(b"ab"), tok)) == "ab" and not r.done and r.remaining == 2
    # a step may bring more tokens than the request may take: the rest is not taken
    assert _text(r.take(list(b"cdef"), tok)) == "cd"
    assert (r.done, r.finish, r.generated) == (True, "length", list(b"abcd"))


def test_end_of_generation_token_ends_with_stop_and_has_no_text() -> None:
    r = _req()
    assert _text(r.take([*b"hi", EOG, *b"x"], ByteTokenizer())) == "hi"
    assert (r.done, r.finish, r.generated) == (True, "stop", [*b"hi", EOG])


def test_stop_string_is_held_back_then_dropped() -> None:
    r, tok = _req(stops=("END",)), ByteTokenizer()
    assert _text(r.take(list(b"ok E"), tok)) == "ok "
    assert not r.done
    assert _text(r.take(list(b"ND more"), tok)) == ""
    assert (r.done, r.finish) == (True, "stop") and r.tail() == ""


def test_a_character_split_across_steps_waits_for_its_second_byte() -> None:
    r, tok = _req(stops=("zz",)), ByteTokenizer()
    deltas = r.take([*b"caf", 1], tok)
    assert _text(deltas) == "caf" and [d.token_ids for d in deltas] == [(99,), (97,), (102,)]
    assert _text(r.take([2], tok)) == "é"
    assert _text(r.take(list(b"!z"), tok)) == "!"
    assert r.tail() == "z"   # a partial stop string is released when generation ends


def test_a_repetition_penalized_step_carries_the_contexts_recent_tokens() -> None:
    from dataclasses import replace

    from meshnode.mesh.final import Counts, Sampling

    tok = ByteTokenizer()
    r = replace(_req(), sampling=Sampling(repeat=1.3, repeat_last_n=2))   # prompt [5, 6, 7]
    assert r.seen_before(2) == Counts(recent=(6, 7))     # the first token's row: the prompt's last 2
    r.take([65, 66], tok)
    assert r.seen_before(4) == Counts(recent=(65, 66))
    assert r.seen_before(3) == Counts(recent=(7, 65))
    assert r.seen_before(5, pending=[67]) == Counts(recent=(66, 67))
    whole = replace(_req(), sampling=Sampling(repeat=1.3, repeat_last_n=-1, presence=0.5))
    whole.take([7, 70], tok)
    assert whole.seen_before(4) == Counts((7, 70), (1, 1), (5, 6, 7, 70))   # distinct ids, ascending
    assert whole.seen_before(5, pending=[71]) == Counts((7, 70, 71), (1, 1, 1), (5, 6, 7, 70, 71))
    assert whole.seen_before(3) == Counts((7,), (1,), (5, 6, 7))            # a step behind: counted afresh


def test_a_step_is_penalized_by_the_answer_up_to_its_last_token() -> None:
    from dataclasses import replace

    from meshnode.mesh.final import Counts, Sampling

    r, tok = _req(), ByteTokenizer()
    assert r.seen_before(3) == Counts()                 # not penalized: nothing counted
    r = replace(r, sampling=Sampling(presence=1.0))     # prompt [5, 6, 7]: positions 0..2
    r.take([65], tok)                                   # the prefill's token, at position 3
    assert r.seen_before(3) == Counts((65,), (1,))      # the first decode step feeds it
    r.take([66, 65], tok)
    assert r.seen_before(5) == Counts((65, 66), (2, 1))
    assert r.seen_before(4) == Counts((65, 66), (1, 1))  # an earlier step, counted afresh
    # a step sent before its tokens are taken (the next step goes first): they count too
    assert r.seen_before(7, pending=[67, 65]) == Counts((65, 66, 67), (3, 1, 1))
    assert r.seen_before(5) == Counts((65, 66), (2, 1))  # the pending ones were not kept
