"""Speculative decoding end to end on a 2-stage split: real node processes on loopback
(QUIC, HTTP), the official openai client.

One stage-1 node stays up for the whole module; the coordinator (stage 0) restarts with
each configuration. Greedy output with speculation (n-gram, a draft model given on the
command line, a draft declared by ``model-package.json``) must equal the output with
``--spec-mode off`` token for token; the response's non-standard ``timings`` shows the
drafting. A draft that cannot be used (missing file, another vocabulary) leaves the node
serving without it, with a clear warning in its log.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.nodeproc import TwoStageSplit, meshnode_cmd

pytestmark = [pytest.mark.slow, pytest.mark.net]

CODE_PROMPT = (
    "Rename the class `Stack` to `LifoQueue` and `data` to `items`. Give the full code.\n\n"
    "```\nclass Stack:\n    def __init__(self):\n        self.data = []\n\n"
    "    def push(self, value):\n        self.data.append(value)\n\n"
    "    def pop(self):\n        return self.data.pop()\n\n"
    "    def size(self):\n        return len(self.data)\n```"
)
CHAT_PROMPT = "Write a short story about a fox who learns to swim."
PROMPTS = (CODE_PROMPT, CHAT_PROMPT)
MAX_TOKENS = 32
# penalties (counted over the answer, row by row inside a verify window) and a logit bias
# (" self" all but banned): speculation must leave such answers as they are too
PENALIZED = {"frequency_penalty": 0.4, "presence_penalty": 0.3, "logit_bias": {"639": -100}}
# the repetition penalty over a window that slides inside a verify window (and the prompt)
REPEATED = {"extra_body": {"repetition_penalty": 1.3, "repeat_last_n": 24}}
NODE_FLAGS = ("--threads", "1", "--ctx", "1024", "--batch", "64", "--parallel", "1")


class Split(TwoStageSplit):
    """Stage 1 (up for the module) and a coordinator restarted per configuration."""

    def __init__(self, root: Path, model: Path) -> None:
        super().__init__(root, model, NODE_FLAGS)

    @property
    def package_file(self) -> Path:
        return self.model.parent / "model-package.json"

    def complete_all(self, **params) -> list[tuple[str, dict]]:
        """Greedy completions of PROMPTS: (text, timings) each."""
        return self.chats([[{"role": "user", "content": p}] for p in PROMPTS], MAX_TOKENS, **params)

    def spec_strategy(self) -> str:
        return self.coord.status()["spec"][0]["strategy"]


@pytest.fixture(scope="module")
def split(smollm2, tmp_path_factory):
    with Split(tmp_path_factory.mktemp("spec-split"), smollm2.path) as s:
        yield s


@pytest.fixture(scope="module")
def references(split) -> dict[str, list[str]]:
    """Plain greedy decoding on the same split (speculation off): of PROMPTS, and of
    PROMPTS with the PENALIZED fields."""
    split.start("--spec-mode", "off")
    out = split.complete_all()
    assert all(t.get("draft_n", 0) == 0 for _, t in out)
    assert all(text for text, _ in out)
    penalized = [text for text, _ in split.complete_all(**PENALIZED)]
    assert penalized[0] != out[0][0] and all(penalized)
    repeated = [text for text, _ in split.complete_all(**REPEATED)]
    assert repeated[0] != out[0][0] and all(repeated)
    return {"plain": [text for text, _ in out], "penalized": penalized, "repeated": repeated}


@pytest.fixture(scope="module")
def reference(references) -> list[str]:
    return references["plain"]


@pytest.fixture
def package(split):
    """Write model-package.json beside the coordinator's model; removed afterwards."""
    def write(strategies: dict, default: str) -> None:
        split.package_file.write_text(json.dumps(
            {"generation": {"speculative_decoding": {"default": default, "strategies": strategies}}}))
    yield write
    split.package_file.unlink(missing_ok=True)
    split.stop_coordinator()


def _drafted(timings: dict) -> bool:
    return timings.get("draft_n", 0) > 0 and timings.get("draft_n_accepted", 0) > 0


def test_ngram_on_equals_plain_greedy(split, references):
    split.start("--spec", "ngram", "--spec-mode", "on")
    out = split.complete_all()
    assert [text for text, _ in out] == references["plain"]
    penalized = split.complete_all(**PENALIZED)
    assert [text for text, _ in penalized] == references["penalized"]
    assert _drafted(penalized[0][1]), penalized[0][1]
    repeated = split.complete_all(**REPEATED)
    assert [text for text, _ in repeated] == references["repeated"]
    assert _drafted(repeated[0][1]), repeated[0][1]
    code_timings = out[0][1]
    assert _drafted(code_timings), code_timings
    assert code_timings["draft_n_accepted"] <= code_timings["draft_n"]
    # Per-request speculation telemetry rides in the response's timings.
    assert code_timings["spec_strategy"] == "ngram" and code_timings["spec_state"] == "enabled"
    assert 1 <= code_timings["draft_windows"] <= code_timings["draft_n"]
    assert code_timings["draft_verify_ms"] > 0 and code_timings["spec_window"] >= 1
    # every emitted token came from the prefill, a plain step or a window (a stop may
    # cut a window short, so the steps can account for more)
    stepped = code_timings["draft_windows"] + code_timings["plain_steps"] + code_timings["draft_n_accepted"]
    assert code_timings["predicted_n"] <= 1 + stepped
    # a lone greedy stream on a split sends lookahead windows in copy runs, and the text
    # above is unchanged whether their guesses held or not
    sent = sum(t["draft_lookahead"] for _, t in out)
    used = sum(t["draft_lookahead_used"] for _, t in out)
    assert sent >= 1 and 0 <= used <= sent, (sent, used)
    assert all(t["draft_model_windows"] == 0 for _, t in out)     # no draft model here
    # /status shows what the windows were sized by: the learned cost of a plain step and
    # of the windows it ran, and the acceptance estimate
    spec = split.coord.status()["spec"][0]
    learned = dict(spec["step_ms"])
    assert 0 in learned and any(k >= 1 for k in learned), learned
    assert all(ms > 0 for ms in learned.values()), learned
    assert 0 < spec["acceptance_estimate"] < 1, spec
    shown = meshnode_cmd("status", "--home", str(split.homes[0])).stdout   # and the terminal too
    assert (f"speculation ngram ({spec['state']}): {spec['accepted']} of {spec['proposed']} drafts accepted "
            f"in {spec['windows']} windows; step cost by drafts plain {learned[0]:.1f}") in shown, shown


def test_a_predicted_output_is_drafted_and_the_text_stays_the_same(split, reference):
    # the story prompt holds nothing to copy; a client that predicts the answer (OpenAI's
    # `prediction`, here the answer itself, then a wrong guess) gets it drafted from that
    from openai import OpenAI

    split.start("--spec", "ngram")            # auto mode: the prediction enables drafting
    client = OpenAI(base_url=f"http://127.0.0.1:{split.coord.info['http_port']}/v1", api_key="none",
                    max_retries=0)
    model = client.models.list().data[0].id
    for guess, right in ((reference[1], True), ("A cat sat on a mat. " * 8, False)):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": CHAT_PROMPT}],
                                           max_tokens=MAX_TOKENS, temperature=0,
                                           prediction={"type": "content", "content": guess})
        timings = (r.model_extra or {}).get("timings") or {}
        assert r.choices[0].message.content == reference[1]
        details = r.usage.completion_tokens_details      # OpenAI's accounting of the guess
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
        if right:
            assert timings["draft_n_accepted"] >= MAX_TOKENS // 2, timings
            assert details.rejected_prediction_tokens == 0, details
            assert details.accepted_prediction_tokens >= r.usage.completion_tokens - 1, (details, r.usage)
        else:
            assert details.accepted_prediction_tokens < details.rejected_prediction_tokens, details


def test_draft_model_equals_plain_greedy(split, reference):
    # The target as its own draft: same vocabulary by construction, drafts mostly accepted.
    # Pinned on: in auto mode a draft as costly as the target is soon only probed here.
    split.start("--draft-model", str(split.model), "--spec-mode", "on")
    assert split.spec_strategy() == "draft"
    out = split.complete_all()
    assert [text for text, _ in out] == reference
    for _, timings in out:
        assert _drafted(timings), timings
        # n-gram drafts first, the draft model where they have none: its windows counted apart
        assert 0 < timings["draft_model_windows"] <= timings["draft_windows"], timings
        assert timings["draft_model_n_accepted"] <= timings["draft_model_n"] <= timings["draft_n"]


def test_a_draft_model_in_auto_mode_measures_plain_steps_first(split, reference):
    # The default mode: the first tokens on a fresh route are plain (what the draft's
    # windows are judged against), then it drafts; the text is the same either way.
    split.start("--draft-model", str(split.model))
    out = split.complete_all()
    assert [text for text, _ in out] == reference
    first = out[0][1]
    assert first["plain_steps"] >= 4 and first["draft_windows"] > 0, first
    spec = split.coord.status()["spec"][0]
    assert spec["strategy"] == "draft" and spec["state"] in ("enabled", "cooling-down"), spec
    assert dict(spec["step_ms"]).get(0, 0) > 0, spec   # plain steps measured on this route


def test_package_declared_draft_and_no_draft(split, reference, package):
    draft = split.model.parent / "draft-copy.gguf"
    try:
        os.link(split.model, draft)
    except OSError:
        shutil.copy2(split.model, draft)
    package({"pkg-draft": {"type": "draft-model", "draft_model": draft.name,
                           "window_policy": {"default": "adaptive", "initial_window": 4,
                                             "min_window": 1, "max_window": 8}}}, "pkg-draft")
    try:
        split.start("--spec-mode", "on")   # the package's draft, pinned on (test_draft_model_equals_plain_greedy)
        assert split.spec_strategy() == "draft"
        out = split.complete_all()
        assert [text for text, _ in out] == reference
        assert all(_drafted(t) for _, t in out), [t for _, t in out]

        split.start("--no-draft")   # the package's draft is turned off: built-in n-gram
        assert split.spec_strategy() == "ngram"
        out = split.complete_all()
        assert [text for text, _ in out] == reference
    finally:
        draft.unlink(missing_ok=True)


def test_unresolvable_package_draft_still_serves(split, reference, package):
    package({"pkg-draft": {"type": "draft-model", "draft_model": "no-such-draft-model.gguf"}},
            "pkg-draft")
    coord = split.start()   # ready: a missing draft never fails the start
    log = coord.log()
    assert "WARNING" in log and "draft model 'no-such-draft-model.gguf' disabled" in log, log[-3000:]
    assert "serving without it" in log
    out = split.complete_all()
    assert [text for text, _ in out] == reference
    assert all(t.get("draft_n", 0) == 0 for _, t in out)


def test_draft_with_another_vocabulary_is_refused(split, reference, tmp_path):
    from meshnode.models.synthetic import write_synthetic_gguf

    other = write_synthetic_gguf(tmp_path / "other-vocab.gguf", vocab=320)
    coord = split.start("--draft-model", str(other))
    log = coord.log()
    assert "WARNING" in log and "disabled" in log and "vocabulary" in log, log[-3000:]
    out = split.complete_all()
    assert [text for text, _ in out] == reference
    assert all(t.get("draft_n", 0) == 0 for _, t in out)
