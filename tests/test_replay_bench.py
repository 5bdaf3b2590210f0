"""`meshnode bench replay`: the offline replay of n-gram drafting (logic and one real run)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshnode.bench.replay_bench import replay
from meshnode.spec.cost_model import CostModel

CODE = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22] * 2


def _cost(plain_ms: float = 40.0, per_draft_ms: float = 15.0) -> CostModel:
    cost = CostModel(step_s=plain_ms / 1000)
    for k in (0, 1, 2, 4, 8, 16):
        cost.observe(k, (plain_ms + per_draft_ms * k) / 1000)
    return cost


def test_an_answer_that_copies_the_prompt_needs_few_steps():
    r = replay([CODE], [CODE[:24]], 12, _cost(), 3)
    assert r["tokens"] == 24
    assert r["steps"] < 24 and r["accepted"] > 0
    assert r["acceptance"] > 0.5 and r["predicted_speedup"] > 1.0
    # every answer token is an accepted draft or the token a step yields (the last step
    # of an answer may end on accepted drafts: its own token falls past the end)
    assert r["tokens"] <= r["accepted"] + r["steps"] <= r["tokens"] + 1


def test_an_unrelated_answer_is_decoded_plainly_at_no_cost():
    prompt, answer = list(range(7, 40)), list(range(100, 130))   # nothing repeats
    r = replay([prompt], [answer], 12, _cost(), 3)
    assert (r["steps"], r["plain_steps"], r["drafts"]) == (30, 30, 0)
    assert r["predicted_speedup"] == 1.0


def test_windows_and_matches_can_be_bounded_as_a_route_bounds_them():
    """--max-window caps every window (a GPU route's 3 drafts); a shorter --min-match
    drafts from shorter repeats (more windows, each less sure)."""
    wide = replay([CODE], [CODE[:24]], 12, _cost(), 3)
    capped = replay([CODE], [CODE[:24]], 12, _cost(), 3, max_window=2)
    assert capped["drafts"] <= 2 * capped["windows"] and capped["steps"] > wide["steps"]
    prompt = [5, 1, 2, 6, 8]     # the answer repeats a 2-token span only
    answer = [1, 2, 9, 3]
    assert replay([prompt], [answer], 12, _cost(), 3)["windows"] == 0
    assert replay([prompt], [answer], 12, _cost(), 1)["windows"] > 0


def test_a_node_drafts_from_two_token_matches_only_where_its_windows_cost_next_to_a_plain_step():
    """``min_match=None`` replays the serving loop's rule (spec/ngram.min_match_for):
    3-token matches until the learned costs say a 1-draft window costs at most
    CHEAP_WINDOW_STEPS plain steps (a GPU split, mostly hops), then 2."""
    from meshnode.spec.ngram import CHEAP_WINDOW_STEPS, MIN_NGRAM_MATCH, min_match_for

    assert min_match_for(None) == MIN_NGRAM_MATCH == 3
    assert min_match_for(CHEAP_WINDOW_STEPS) == 2 and min_match_for(1.52) == 3   # this VM's split
    # the text copies a long span first (3-token matches: windows get measured), then
    # repeats only 2-token spans (12, 13 are followed by 99 once more)
    prompt = CODE + [12, 13, 99, 50, 51, 98]
    answer = CODE[:12] + [60, 12, 13, 99, 61, 50, 51, 98]
    # (the rule alone: the copy cursor would draft after the inserted 60 and 61 too)
    cheap = replay([prompt], [answer], 12, _cost(40.0, 1.0), None, cursor=False)
    dear = replay([prompt], [answer], 12, _cost(40.0, 40.0), None, cursor=False)
    assert dear["accepted"] == replay([prompt], [answer], 12, _cost(40.0, 40.0), 3, cursor=False)["accepted"]
    # cheap windows: the 2-token spans drafted too, once the costs are learned
    assert dear["accepted"] < cheap["accepted"] <= \
        replay([prompt], [answer], 12, _cost(40.0, 1.0), 2, cursor=False)["accepted"]


def test_the_min_match_option_takes_numbers_and_auto():
    import argparse

    from meshnode.bench.replay_bench import _min_matches

    assert _min_matches("2,auto,3") == [2, None, 3]
    for bad in ("0", "x", "", "2,-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _min_matches(bad)


def test_the_copy_cursor_takes_a_renamed_copy_in_fewer_steps():
    """An answer that copies the prompt with every other stretch renamed: the cursor
    drafts again two tokens after each rename, the suffix match only after three."""
    source = list(range(100, 160))
    answer = [900 + t if t % 12 == 0 else t for t in source]
    on = replay([source], [answer], 12, _cost(), 3)
    off = replay([source], [answer], 12, _cost(), 3, cursor=False)
    assert on["accepted"] > off["accepted"] and on["steps"] < off["steps"]
    assert on["tokens"] == off["tokens"] == len(answer)


def test_the_cursor_option_takes_on_and_off():
    import argparse

    from meshnode.bench.replay_bench import _switches

    assert _switches("on,off") == [True, False] and _switches("off") == [False]
    for bad in ("", "yes", "on,x"):
        with pytest.raises(argparse.ArgumentTypeError):
            _switches(bad)


class _OracleDraft:
    """A draft model stand-in for the replay's logic: proposes the known answer's next
    tokens, one "call" per draft (as a draft does after catching up)."""

    def __init__(self, prompt: list[int], answer: list[int]) -> None:
        self.whole = prompt + answer
        self.context: list[int] = []
        self.calls = 0

    @property
    def stats(self):
        from meshnode.spec.draft import DraftStats

        return DraftStats(calls=self.calls)

    def reset(self, prompt, *, sync=True):
        self.context = list(prompt)

    def propose(self, tail, k):
        got = self.whole[len(self.context):len(self.context) + k]
        self.calls += len(got)
        return got

    def accept(self, tokens):
        self.context += list(tokens)


def test_a_draft_model_drafts_where_the_n_gram_proposer_has_nothing():
    prompt, answer = list(range(7, 40)), list(range(100, 160))   # nothing repeats
    r = replay([prompt], [answer], 12, _cost(), 3, draft=_OracleDraft(prompt, answer), draft_ms=0.0)
    assert r["plain_steps"] == 0 and r["acceptance"] == 1.0 and r["predicted_speedup"] > 1.5
    # each draft call charged: dearer calls, a smaller predicted gain
    r2 = replay([prompt], [answer], 12, _cost(), 3, draft=_OracleDraft(prompt, answer), draft_ms=30.0)
    assert r2["predicted_speedup"] < r["predicted_speedup"]


def test_draft_windows_are_sized_by_what_the_draft_s_calls_cost():
    """The learned cost model charges a draft window its draft calls: free calls grow
    the windows, calls dearer than a plain step keep them near one draft; shared with
    the n-gram windows or a window of their own (``hybrid-split``)."""
    prompt = CODE + list(range(40, 60))
    answer = CODE[:20] + list(range(100, 160))     # copies the prompt, then new text
    for split in (False, True):
        free, dear = (replay([prompt], [answer], 12, _cost(), 3, draft=_OracleDraft(prompt, answer),
                             draft_ms=ms, split_windows=split) for ms in (0.0, 60.0))
        assert free["drafts"] / free["windows"] > 3 and dear["drafts"] / dear["windows"] < 1.5
        assert free["plain_steps"] == dear["plain_steps"] == 0


def test_the_window_is_sized_by_costs_learned_as_it_goes():
    """A node's window starts from the cost prior and learns: where a verify row costs as
    much as a plain step, windows stay smaller than where rows are nearly free."""
    prompt, answer = CODE, CODE[:24] * 3
    dear = replay([prompt], [answer], 12, _cost(40.0, 40.0), 3)
    cheap = replay([prompt], [answer], 12, _cost(40.0, 1.0), 3)
    assert dear["drafts"] / dear["windows"] < cheap["drafts"] / cheap["windows"]


def test_without_the_n_gram_proposer_every_step_asks_the_draft():
    answer = CODE[:24]
    draft = _OracleDraft(CODE, answer)
    r = replay([CODE], [answer], 12, _cost(), 3, draft=draft, n_gram=False)
    assert r["plain_steps"] == 0 and draft.calls == r["drafts"]


@pytest.mark.slow
def test_bench_replay_runs_on_the_default_model(smollm2, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "meshnode", "--home", str(tmp_path), "bench", "replay",
         "--model", str(smollm2.path), "--prompts", "1", "--tokens", "12", "--max-n", "4,12", "--json"],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out) == {"step_ms", "code_edit", "mixed_chat"}
    for workload in ("code_edit", "mixed_chat"):
        # rows per proposer and max_n (the suffix proposer's with its history minimum)
        assert set(out[workload]) == {"ngram/4", "ngram/12", "suffix/4/h4", "suffix/12/h4"}
        for key in out[workload]:
            row = out[workload][key]
            assert 1 <= row["tokens"] <= 12
            assert row["tokens"] <= row["accepted"] + row["steps"] <= row["tokens"] + 1
            assert row["predicted_speedup"] > 0
    assert float(out["step_ms"]["16"]) > float(out["step_ms"]["0"]) > 0
