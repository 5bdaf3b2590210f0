"""A CPU engine's thread count changes between calls (engine/threads.py) without
changing any result: real llama.cpp on real models, each call at another count against
an engine that keeps one."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import llama_cpp
from meshnode.engine import EngineConfig, Segment, StageEngine
from meshnode.state import StageInfo, StageState

pytestmark = pytest.mark.slow


class Cycle:
    """Stands in for the governor: a different count for every call, and a record of the
    counts each call was computed with."""

    def __init__(self, engine: StageEngine, counts: list[int]) -> None:
        self.engine = engine
        self.next = itertools.cycle(counts)
        self.used: list[int] = []

    def threads_for(self, rows: int) -> int:
        return next(self.next)

    def observe(self, rows: int, seconds: float, threads: int) -> None:
        self.used.append(int(llama_cpp.llama_n_threads_batch(self.engine._ctx)))
        assert threads == self.used[-1]


PROMPT = 600   # past 512 cells, where llama.cpp would split an f16 cache's attention by thread


def _calls(eng: StageEngine, toks: np.ndarray) -> list[np.ndarray]:
    """Prefill in chunks, one-row steps, a verify window rolled back, more steps."""
    out = []
    for a in range(0, PROMPT, 64):
        out.append(eng.forward([Segment(0, a, tokens=toks[a:min(a + 64, PROMPT)], n_logits=1)])[0])
    pos = PROMPT
    for t in toks[PROMPT:PROMPT + 12]:
        out.append(eng.forward([Segment(0, pos, tokens=np.asarray([t], np.int32))])[0])
        pos += 1
    out.append(eng.forward([Segment(0, pos, tokens=toks[PROMPT + 12:PROMPT + 17], n_logits=5)])[0])
    eng.rollback(0, pos + 2)
    pos += 2
    for t in toks[PROMPT + 20:PROMPT + 26]:
        out.append(eng.forward([Segment(0, pos, tokens=np.asarray([t], np.int32))])[0])
        pos += 1
    return out


@pytest.mark.parametrize("model", ["smollm2", "gemma3_270m"])
def test_results_do_not_depend_on_the_thread_count_of_each_call(model, request):
    path = request.getfixturevalue(model)
    path = getattr(path, "path", path)
    toks = np.asarray([(17 * i + 5) % 4000 + 10 for i in range(PROMPT + 30)], np.int32)
    cfg = dict(n_ctx=PROMPT + 64, n_seq_max=1, n_batch=64)
    with StageEngine(EngineConfig(path, n_threads=2, adapt_threads=False, **cfg)) as fixed:
        assert fixed._governor is None
        want = _calls(fixed, toks)
    with StageEngine(EngineConfig(path, n_threads=3, adapt_threads=True, **cfg)) as eng:
        assert eng.kv_type == "q8_0" and eng._governor is not None
        eng._governor = cycle = Cycle(eng, [1, 2, 3])
        got = _calls(eng, toks)
    assert set(cycle.used) == {1, 2, 3}          # the counts reached llama.cpp
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g, w), f"call {i} differs"


def test_an_engine_adapts_only_where_no_count_changes_a_result(smollm2, monkeypatch):
    cfg = dict(n_ctx=64, n_seq_max=1)
    with StageEngine(EngineConfig(smollm2.path, n_threads=2, **cfg)) as eng:
        assert eng._governor is not None and eng._governor.most == 2
    # an f16 KV cache splits a row's attention over the threads: no adapting there
    with StageEngine(EngineConfig(smollm2.path, n_threads=2, kv_type="f16", **cfg)) as eng:
        assert eng._governor is None
    # nor with separate counts for one-row steps, nor with one thread
    with StageEngine(EngineConfig(smollm2.path, n_threads=2, decode_threads=1, **cfg)) as eng:
        assert eng._governor is None
    with StageEngine(EngineConfig(smollm2.path, n_threads=1, **cfg)) as eng:
        assert eng._governor is None
    monkeypatch.setenv("MESHNODE_ADAPT_THREADS", "0")
    with StageEngine(EngineConfig(smollm2.path, n_threads=2, **cfg)) as eng:
        assert eng._governor is None


def test_the_governor_s_count_reaches_llama_cpp(smollm2):
    with StageEngine(EngineConfig(smollm2.path, n_ctx=64, n_seq_max=1, n_threads=2)) as eng:
        gov = eng._governor
        for pos in range(4):                  # four one-row calls: a shape to try with
            eng.forward([Segment(0, pos, tokens=np.asarray([1 + pos], np.int32))])
        gov._since = gov._interval            # a try starts after the next one-row call
        eng.forward([Segment(0, 4, tokens=np.asarray([5], np.int32))])
        assert gov.trying == 1 and eng.threads == 2
        eng.forward([Segment(0, 5, tokens=np.asarray([6, 7], np.int32))])   # another shape: settled count
        assert llama_cpp.llama_n_threads_batch(eng._ctx) == 2
        eng.forward([Segment(0, 7, tokens=np.asarray([8], np.int32))])      # the tried shape
        assert llama_cpp.llama_n_threads_batch(eng._ctx) == 1 == llama_cpp.llama_n_threads(eng._ctx)
        # whatever the count, the engine's calls stay on its compute thread (never inline)
        gov.threads = 1
        assert eng.threads == 1 and eng.threads_for(1) == 2
        # and the settled count is what the TUI and `meshnode status` show for the stage
        shown = eng.describe(StageInfo(0, "n", "n", 0, 30, StageState.READY))
        assert (shown.backend, shown.threads, shown.max_threads, shown.compute) == ("cpu", 1, 2, "cpu, 1 of 2 threads")


def test_bench_engine_compares_the_adaptive_count_with_the_fixed_one(tmp_path, smollm2):
    import json
    import subprocess

    from nodeproc import env, meshnode_argv

    r = subprocess.run(
        meshnode_argv("bench", "engine", str(smollm2.path), "--home", str(tmp_path / "home"), "--threads", "2",
                      "--splits", "15", "--tokens", "40", "--warmup", "2", "--prefill", "32", "--reps", "1",
                      "--windows", "none", "--gap-ms", "0", "--adapt", "--json"),
        env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "whole model, adaptive threads:" in r.stdout
    out = json.loads(r.stdout.strip().splitlines()[-1])
    ad = out["adaptive_threads"]
    assert sum(ad["threads_used"].values()) == 40
    assert set(ad["threads_used"]) <= {"1", "2"}
    assert ad["ratio"] == pytest.approx(ad["ms_per_token"] / out["decode_ms_per_token"]["whole"])
    assert out["chain_logits_identical"] is True     # the adaptive copy's logits included
