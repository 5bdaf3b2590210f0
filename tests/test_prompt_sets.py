"""The speculation benchmarks' prompt sets: enough prompts of every kind, a fixed
tune / held-out split, whole editor sequences, and a loader that refuses malformed files."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from meshnode.bench.prompt_sets import load, select


@pytest.mark.parametrize("workload", ["code_edit", "mixed_chat"])
def test_sets_are_large_varied_and_split_in_two(workload):
    prompts = load(workload)
    assert len(prompts) >= 30
    kinds = Counter(p.kind for p in prompts)
    assert len(kinds) >= 6
    tune, held = select(prompts, "tune"), select(prompts, "heldout")
    assert {p.id for p in tune}.isdisjoint(p.id for p in held)
    assert len(tune) + len(held) == len(prompts)
    # every kind is on both sides, so the held-out half reports what the tune half tuned
    assert {p.kind for p in tune} == {p.kind for p in held} == set(kinds)
    quick = select(prompts, "heldout", quick=True)
    assert 0 < len(quick) < len(held) and all(p.quick for p in quick)


def test_code_edits_cover_the_edit_kinds_files_and_editor_sequences():
    prompts = load("code_edit")
    assert {"rename", "add_types", "refactor", "fix_bug", "translate", "add_tests", "editor"} <= \
        {p.kind for p in prompts}
    lines = [p.messages[-1][1].count("\n") for p in prompts]
    assert min(lines) >= 50 and max(lines) >= 200
    assert len({p.messages[-1][1].split("```")[1].split("\n")[0] for p in prompts}) >= 6  # languages
    seqs = {p.sequence for p in prompts if p.sequence}
    assert len(seqs) >= 2
    for name in seqs:
        steps = [p for p in prompts if p.sequence == name]
        assert len(steps) >= 3 and len({p.split for p in steps}) == 1
        # the same request, the file a little changed each time
        assert len({p.messages[-1][1].split("\n\n")[0] for p in steps}) == 1
        assert len({p.messages[-1][1] for p in steps}) == len(steps)


def test_chat_has_multi_turn_conversations():
    multi = [p for p in load("mixed_chat") if len(p.messages) >= 3]
    assert len(multi) >= 6
    assert all(p.messages[-1][0] == "user" for p in multi)


def test_limit_keeps_sequences_whole():
    prompts = load("code_edit")
    seq = [p for p in prompts if p.sequence][0]
    first_seq = select(prompts, seq.split)
    i = next(k for k, p in enumerate(first_seq) if p.sequence)
    units_before = len({p.client for p in first_seq[:i]})
    got = select(prompts, seq.split, limit=units_before + 1)
    assert [p.sequence for p in got].count(first_seq[i].sequence) == \
        sum(1 for p in prompts if p.sequence == first_seq[i].sequence)


def test_malformed_files_are_refused(tmp_path):
    def write(prompts):
        (tmp_path / "mixed_chat.json").write_text(json.dumps({"prompts": prompts}))

    good = {"id": "a", "kind": "q", "split": "tune", "messages": [{"role": "user", "content": "hi"}]}
    write([good])
    assert load("mixed_chat", tmp_path)[0].chat() == [{"role": "user", "content": "hi"}]
    for bad, match in [({**good, "split": "both"}, "split"),
                       ({**good, "messages": [{"role": "robot", "content": "x"}]}, "messages"),
                       ({**good, "messages": [{"role": "assistant", "content": "x"}]}, "last message")]:
        write([bad])
        with pytest.raises(ValueError, match=match):
            load("mixed_chat", tmp_path)
    write([good, good])
    with pytest.raises(ValueError, match="duplicate"):
        load("mixed_chat", tmp_path)
    with pytest.raises(ValueError, match="split"):
        select([], "half")


def test_spec_bench_by_kind_compares_fastest_rounds():
    from meshnode.bench.prompt_sets import BenchPrompt
    from meshnode.bench.spec_bench import _by_kind

    def run(wall, n=0, acc=0):
        return {"wall_s": wall, "timings": {"draft_n": n, "draft_n_accepted": acc}}

    prompts = [BenchPrompt("a", "code_edit", "rename", "heldout", (("user", "x"),)),
               BenchPrompt("b", "code_edit", "fix_bug", "heldout", (("user", "y"),))]
    base = [[run(4.0), run(3.0)], [run(2.0)]]
    ngram = [[run(2.0, 10, 8), run(1.5, 10, 8)], [run(2.5, 4, 0)]]
    got = _by_kind(ngram, base, prompts)
    assert got["rename"] == {"prompts": 1, "wall_speedup": 2.0, "acceptance": 0.8}
    assert got["fix_bug"] == {"prompts": 1, "wall_speedup": 0.8, "acceptance": 0.0}


def test_spec_bench_decode_rate_is_tokens_over_time_not_a_mean_of_rates():
    from meshnode.bench.spec_bench import _summary

    def run(n, ms, wall=1.0):
        return {"wall_s": wall, "tokens": n, "text": "t", "ttft_s": 0.1,
                "timings": {"predicted_n": n, "predicted_ms": ms, "predicted_per_second": 1e3 * n / ms}}

    # a short fast answer and a long slow one: 110 tokens in 1.1 s, not the mean of 100 and 50
    got = _summary([[run(10, 100.0)], [run(100, 2000.0), run(100, 1000.0)]])
    assert got["tok_s"] == pytest.approx(1e3 * 110 / 1100.0)
    assert _summary([[{"wall_s": 0.0, "tokens": 0, "text": "", "ttft_s": 0.0, "timings": {}}]])["tok_s"] == 0.0
