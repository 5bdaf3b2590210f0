"""The soak benchmark's judgement of an answer and its resume-time arithmetic (pure logic;
the soak itself is a benchmark command, `meshnode bench soak`)."""

from meshnode.bench.soak_bench import _resume_times, _Result, classify, percentile

REF = "The sea is wide and blue, the waves come in and out."


def test_identical_and_prefix_are_same():
    assert classify(REF, REF) == "same"
    assert classify(REF, REF[:20]) == "same"      # a client that hung up part way


def test_missing_piece_is_lost():
    assert classify(REF, REF.replace(" wide and", "")) == "lost"


def test_piece_said_twice_is_repeated():
    i = REF.index(" blue")
    assert classify(REF, REF[:i] + " blue" + REF[i:]) == "repeated"


def test_other_difference_is_mismatch():
    assert classify(REF, REF.replace("blue", "grey")) == "mismatch"
    assert classify(REF, REF + " extra") == "mismatch"


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 10.0], 95) == 10.0


def test_resume_time_is_the_gap_that_spans_the_kill():
    r = _Result(prompt=0, stream=True, stamps=[1.0, 1.1, 3.6, 3.7], t0=0.5, t1=3.8)
    assert _resume_times([r], [2.0]) == [2.5]
    assert _resume_times([r], [5.0]) == []        # not in flight
    failed = _Result(prompt=0, stream=True, status="http 503", stamps=[1.0], t0=0.5, t1=2.5)
    assert _resume_times([failed], [2.0]) == []


def test_failures_are_reported_with_their_messages():
    from meshnode.bench.soak_bench import _summarize

    bad = [_Result(prompt=0, stream=True, status="error chunk", detail="no route to the model's stages: x"),
           _Result(prompt=1, stream=True, status="error chunk", detail="no route to the model's stages: x"),
           _Result(prompt=0, stream=False, status="http 503", detail="engine unavailable")]
    out = _summarize([*bad, _Result(prompt=0, stream=False, text="ok")], {0: "ok", 1: "ok"}, [], {}, 1.0)
    assert out["failed"] == 3 and out["completed"] == 1
    assert out["failures"] == [{"error": "error chunk: no route to the model's stages: x", "count": 2},
                               {"error": "http 503: engine unavailable", "count": 1}]
