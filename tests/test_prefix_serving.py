"""Prefix reuse across requests on a 2-stage split: real node processes on loopback (QUIC,
HTTP), real llama.cpp on SmolLM2, the editor-like sequences of the benchmark prompt set
(the same file sent again with small edits).

One stage-1 node stays up for the module; the coordinator restarts per configuration.
Reference: every request prefilled cold (``--prefix-cache 0``). With the cache on, a
request whose prompt begins with an earlier one's tokens copies that KV on both stages
(``timings.cache_n``) and its greedy answer is the cold one token for token, speculation
off and on, one client or two at once; the stage-1 node then holds exactly the sessions
the coordinator's cache keeps.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from meshnode.bench import prompt_sets
from meshnode.serve.prefix_cache import MIN_PREFIX
from tests.nodeproc import TwoStageSplit, meshnode_cmd, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.net]

MAX_TOKENS = 24
PARALLEL = 3            # the cache keeps at most PARALLEL - 1 sessions
NODE_FLAGS = ("--threads", "1", "--ctx", "1024", "--batch", "64", "--parallel", str(PARALLEL))


def _sequences() -> dict[str, list[list[dict[str, str]]]]:
    """Two editor sequences (each: the same file, a little changed each step)."""
    seqs: dict[str, list] = {}
    for p in prompt_sets.load("code_edit"):
        if p.sequence in ("editor-users", "editor-cache"):
            seqs.setdefault(p.sequence, []).append(p.chat())
    assert len(seqs) == 2 and all(len(v) >= 3 for v in seqs.values())
    return seqs


SEQUENCES = _sequences()


class Split(TwoStageSplit):
    def __init__(self, root: Path, model: Path) -> None:
        super().__init__(root, model, NODE_FLAGS)

    def run_sequence(self, name: str, steps: slice = slice(None)) -> list[tuple[str, dict]]:
        """The steps of one editor sequence in order, as one client: (text, timings)."""
        return self.chats(SEQUENCES[name][steps], MAX_TOKENS)

    def sessions_settle(self) -> dict:
        """Once requests are done: stage 1 holds exactly the sessions the cache keeps."""
        def settled() -> bool:
            st = self.coord.status()
            kept = st["prefix_cache"]["sessions"]
            return (len(self.stage1.status().get("stage_sessions")) == kept
                    and st["model_sessions"] == kept)
        wait_for(settled, 15)
        return self.coord.status()["prefix_cache"]


@pytest.fixture(scope="module")
def split(smollm2, tmp_path_factory):
    with Split(tmp_path_factory.mktemp("prefix-split"), smollm2.path) as s:
        yield s


@pytest.fixture(scope="module")
def cold(split) -> dict[str, list[str]]:
    """Every step prefilled in full: the cache off, speculation off."""
    split.start("--prefix-cache", "0", "--spec-mode", "off")
    out = {name: split.run_sequence(name) for name in SEQUENCES}
    assert all(t.get("cache_n") == 0 for steps in out.values() for _, t in steps)
    assert split.coord.status()["prefix_cache"]["capacity"] == 0
    split.sessions_settle()
    assert split.stage1.status()["stage_sessions"] == []
    return {name: [text for text, _ in steps] for name, steps in out.items()}


@pytest.mark.parametrize("spec", [("--spec-mode", "off"), ("--spec", "ngram", "--spec-mode", "on")],
                         ids=["plain", "ngram"])
def test_warm_answers_equal_cold_answers(split, cold, spec):
    split.start(*spec)
    name = "editor-users"
    out = split.run_sequence(name)
    assert [text for text, _ in out] == cold[name]
    # the first step is cold; every later one reused the earlier file's KV
    assert out[0][1]["cache_n"] == 0
    for _, t in out[1:]:
        assert t["cache_n"] >= MIN_PREFIX, t
    if spec[-1] == "on":
        assert sum(t["draft_n_accepted"] for _, t in out) > 0
    # the last step sent again: all of its prompt but the last token is reused
    [again] = split.run_sequence(name, slice(-1, None))
    assert again[0] == cold[name][-1]
    last = out[-1][1]
    assert again[1]["cache_n"] == last["cache_n"] + last["prompt_n"] - 1 and again[1]["prompt_n"] == 1
    stats = split.sessions_settle()
    assert 1 <= stats["sessions"] <= PARALLEL - 1
    assert stats["hits"] == len(out) and stats["tokens_reused"] == sum(t["cache_n"] for _, t in out) + \
        again[1]["cache_n"]
    shown = meshnode_cmd("status", "--home", str(split.homes[0])).stdout
    assert f"prefix reuse: {stats['sessions']}/{PARALLEL - 1} sessions kept, {stats['hits']} hits" in shown, shown


def test_two_clients_at_once_evict_and_stay_exact(split, cold):
    split.start("--spec", "ngram", "--spec-mode", "on", "--prefix-cache", "1")
    with ThreadPoolExecutor(2) as ex:
        got = dict(zip(SEQUENCES, ex.map(split.run_sequence, SEQUENCES)))
    for name, steps in got.items():
        assert [text for text, _ in steps] == cold[name], name
    stats = split.sessions_settle()
    # one kept session for two clients: they take it from each other
    assert stats["capacity"] == 1 and stats["sessions"] == 1 and stats["evicted"] >= 1


def _scored_batch(split) -> tuple[list[dict], dict]:
    """lm-eval's multiple choice as one batch: a long shared context, one prompt per
    answer choice, each scored (echo, logprobs) with one token generated. The choices
    (text, logprobs) and the prefix cache's counters."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{split.coord.info['http_port']}/v1", api_key="none", max_retries=0)
    context = SEQUENCES["editor-users"][0][-1]["content"][:1500] + "\nWhich letter names the change?\nAnswer:"
    r = client.completions.create(model=client.models.list().data[0].id, prompt=[context + c for c in " ABCD"[1:]],
                                  echo=True, logprobs=2, max_tokens=1, temperature=0)
    return [c.model_dump() for c in r.choices], split.coord.status()["prefix_cache"]


def test_a_scored_batch_computes_its_shared_context_once(split):
    split.start("--prefix-cache", "0", "--spec-mode", "off")
    cold, _ = _scored_batch(split)
    assert len(cold) == 4 and all(len(c["logprobs"]["token_logprobs"]) > 300 for c in cold)
    split.start("--spec-mode", "off")
    warm, stats = _scored_batch(split)
    # the first prompt leads, the other three copy the context's KV and its scores
    assert warm == cold
    assert stats["hits"] == 3 and stats["tokens_reused"] >= 3 * 300, stats
    # the same batch again: its leader too finds the context kept
    again, stats2 = _scored_batch(split)
    assert again == cold and stats2["hits"] >= stats["hits"] + 2, stats2
