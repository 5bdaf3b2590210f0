"""``certify --schedule``: verify windows against one-row steps (what exact speculation
needs), and the padding GPU nodes use, checked on CPU with real llama.cpp.

On the GPU the same check runs by hand (packaging/gpu/measure.sh); here it runs on
SmolLM2 with one thread, where llama.cpp's CPU kernels are batch-invariant.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from meshnode.certify import schedule_check
from meshnode.engine import EngineConfig, Segment, StageEngine
from meshnode.engine import stage as stage_mod
from meshnode.engine.callshape import TIMED_CALLS, WARM_CALLS, CallShapeTimes, time_call_shapes
from meshnode.limits import GPU_STICKY_CALLS
from nodeproc import env, meshnode_argv

pytestmark = pytest.mark.slow


def test_windows_reproduce_one_row_steps_on_cpu(smollm2):
    rep = schedule_check(smollm2.path, contexts=(16, 100), windows=(2, 4, 8), n_steps=8, n_threads=1)
    assert rep.backend == "cpu" and rep.gpu_layers == 0
    assert [(c.context, c.window) for c in rep.cases] == [(16, 2), (16, 4), (16, 8), (100, 2), (100, 4), (100, 8)]
    # and the two sessions (one per context) decoded together, against each alone
    assert rep.together is not None and rep.together.contexts == [16, 100]
    assert rep.exact, rep.to_json()


def test_sessions_together_that_differ_make_the_schedule_inexact():
    from meshnode.certify import ScheduleReport, TogetherCase

    rep = ScheduleReport("m", "cuda", 9, together=TogetherCase([16, 600], 0.5, 1, True))
    assert not rep.exact and rep.max_abs_diff == 0.5
    assert rep.to_json()["together"]["sessions_differ"] == 1


def test_k_quant_windows_reproduce_one_row_steps_on_cpu(gemma3_270m):
    """Gemma 3 270M Q4_K_M: llama.cpp's tiled matmul for k-quant weights (8+ rows of a
    batch) rounds differently from its one-row kernel, so a node turns it off
    (offload.BACKEND_ENV); with it on, windows of 8 and 16 rows gave other greedy tokens."""
    import os

    rep = schedule_check(gemma3_270m, contexts=(16, 100), windows=(2, 8, 16), n_steps=8, n_threads=1)
    assert os.environ.get("GGML_CPU_TILED_MM") == "0"
    assert rep.exact, rep.to_json()


def test_padded_steps_are_the_first_rows_of_a_full_width_call(smollm2):
    """What GPU nodes do: a call of fewer than ``pad_rows`` rows runs as ``pad_rows`` rows,
    the extra rows rolled back; each row's result is its row of the full-width call."""
    toks = np.arange(10, 30, dtype=np.int32)
    nxt = np.asarray([7, 8, 9, 11], np.int32)
    cfg = dict(n_ctx=64, n_seq_max=1, n_threads=1)
    with StageEngine(EngineConfig(smollm2.path, pad_rows=4, **cfg)) as eng:
        assert eng.pad_rows == 4
        eng.run_session(0, 0, toks, n_logits=1)
        one = eng.forward([Segment(0, 20, tokens=nxt[:1], n_logits=1)])[0]
        assert one.shape == (1, eng.n_vocab) and eng.next_pos(0) == 21   # the extra rows are gone
        three = eng.forward([Segment(0, 20, tokens=nxt[:3], n_logits=2)], rewind=True)[0]
        assert three.shape == (2, eng.n_vocab) and eng.next_pos(0) == 23
        full = eng.forward([Segment(0, 20, tokens=nxt, n_logits=4)], rewind=True)[0]
    assert np.array_equal(one[0], full[0])
    assert np.array_equal(three, full[1:3])


def test_a_pad_width_out_of_range_is_refused(smollm2):
    from meshnode.engine.errors import EngineInputError

    with pytest.raises(EngineInputError, match="pad_rows must be an integer in"):
        StageEngine(EngineConfig(smollm2.path, n_ctx=64, n_seq_max=1, pad_rows=0))


def test_the_certify_command_reports_the_schedule_as_json(smollm2):
    r = subprocess.run(meshnode_argv("models", "certify", str(smollm2.path), "--schedule", "--contexts", "16",
                                     "--windows", "2,4", "--threads", "1", "--json"),
                       capture_output=True, text=True, env=env(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["exact"] is True and out["schedule"]["exact"] is True
    assert [c["window"] for c in out["schedule"]["cases"]] == [2, 4]
    assert out["schedule"]["together"] is None     # one context: no sessions to put together


def test_bad_schedule_options_are_one_line_errors(smollm2):
    r = subprocess.run(meshnode_argv("models", "certify", str(smollm2.path), "--schedule", "--windows", "1,64"),
                       capture_output=True, text=True, env=env(), timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--windows must be numbers in 2..32" in r.stderr


def test_on_a_gpu_the_schedule_cuts_windows_where_a_route_does():
    """certify --schedule checks the windows a route sends: on CPU whole windows, on a GPU
    cut at the KV bucket edges (limits.gpu_bucket_drafts): after 490 tokens, with pad 2,
    the one-row step at position 510 (step 20) fills cells up to 512 and the one at 511
    crosses into the next bucket, so a window ends at step 20."""
    from meshnode.certify import schedule_windows

    assert schedule_windows(490, 32, 8, "cpu", 1) == [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert schedule_windows(490, 32, 8, "cuda", 2) == [(0, 8), (8, 8), (16, 5), (21, 8), (29, 3)]
    assert schedule_windows(200, 32, 8, "cuda", 2) == [(0, 8), (8, 8), (16, 8), (24, 8)]   # inside one bucket


def test_sessions_together_on_a_padding_engine_run_as_alone_alike_calls(smollm2):
    """What GPU nodes do with several sessions in one forward (docs/engine.md "GPU",
    "Sessions together"): with pad 2, one-/two-row segments whose padded cells end in one
    KV bucket go in pairs, each padded to 2 rows; every other segment runs alone. Each
    output equals the session's output alone, positions advance by the real rows only."""
    rng = np.random.default_rng(3)
    ctx = {0: 10, 1: 20, 2: 255, 3: 30, 4: 300}
    rows = {0: 1, 1: 1, 2: 1, 3: 3, 4: 1}
    streams = {s: rng.integers(0, 2000, size=c + rows[s], dtype=np.int32) for s, c in ctx.items()}
    cfg = dict(n_ctx=512, n_seq_max=5, n_threads=1, n_batch=64)

    def segs():
        return [Segment(s, ctx[s], tokens=streams[s][ctx[s]:], n_logits=rows[s]) for s in ctx]

    with StageEngine(EngineConfig(smollm2.path, pad_rows=2, **cfg)) as eng:
        for s, c in ctx.items():
            for a in range(0, c, 64):
                eng.forward([Segment(s, a, tokens=streams[s][a:min(c, a + 64)], n_logits=0)])
        alone = [eng.forward([seg])[0] for seg in segs()]
        for s, c in ctx.items():
            eng.rollback(s, c)
        calls: list[list[tuple[int, int]]] = []
        real = eng._forward
        eng._forward = lambda part: calls.append([(x.session, x.n_rows) for x in part]) or real(part)
        together = eng.forward(segs())
        assert [eng.next_pos(s) for s in ctx] == [ctx[s] + rows[s] for s in ctx]
        # a bad segment anywhere in the batch changes nothing
        with pytest.raises(Exception, match="position"):
            eng.forward([Segment(0, ctx[0] + 1, tokens=streams[0][:1], n_logits=1),
                         Segment(1, 5, tokens=streams[1][:1], n_logits=1)])
        assert [eng.next_pos(s) for s in ctx] == [ctx[s] + rows[s] for s in ctx]
    # sessions 0 and 1 (cells end in bucket 1) and 2 and 4 (bucket 2) in pairs of 2-row
    # segments; the 3-row window of session 3 alone
    assert calls == [[(0, 2), (1, 2)], [(2, 2), (4, 2)], [(3, 3)]]
    for a, t in zip(alone, together):
        assert a.shape == t.shape and np.array_equal(a, t)


def test_alone_alike_groups_pair_short_segments_of_one_bucket():
    from meshnode.engine.stage import _alone_alike_groups

    def seg(pos, n=1):
        return Segment(pos, pos, tokens=np.zeros(n, np.int32), n_logits=n)

    segs = [seg(0), seg(300), seg(253), seg(254), seg(10, 2), seg(20, 5), seg(500)]
    # 0+2 and 253+2 end in bucket 1, 10+2 too; 254+2 = 256 ends in bucket 1 as well;
    # 300+2 and 500+2 in bucket 2; the 5-row segment alone
    assert _alone_alike_groups(segs, 2, 1024, 64) == [[0, 2], [1, 6], [3, 4], [5]]
    assert _alone_alike_groups(segs, 4, 1024, 64) == [[i] for i in range(len(segs))]
    assert _alone_alike_groups([seg(1022), seg(1000)], 2, 1024, 64) == [[0, 1]]
    assert _alone_alike_groups([seg(1023), seg(1000)], 2, 1024, 64) == [[0], [1]]
    # a 2-row segment asking one logit row runs alone (its head runs 1 row alone)
    two_one = Segment(5, 5, tokens=np.zeros(2, np.int32), n_logits=1)
    two_none = Segment(6, 6, tokens=np.zeros(2, np.int32), n_logits=0)
    assert _alone_alike_groups([seg(0), two_one, two_none], 2, 1024, 64) == [[0, 2], [1]]


def test_a_padding_engine_keeps_one_call_shape_while_windows_come(smollm2, monkeypatch):
    """A GPU engine (pad 2) with $MESHNODE_GPU_STICKY_CALLS set runs its small calls 4 rows
    wide for that many calls after a window of 3-4 rows (one shape: llama.cpp keeps replaying its CUDA graph), not
    where those rows would end in another KV bucket than a 2-row step's; every result is
    the row an unpadded engine computes, positions advance by the real rows only."""
    monkeypatch.setenv("MESHNODE_GPU_STICKY_CALLS", "3")
    path = smollm2.path   # (a q8_0 KV cache: rows are batch-invariant on the CPU)
    rng = np.random.default_rng(1)
    stream = rng.integers(3, 2000, size=300, dtype=np.int32)
    cfg = dict(n_ctx=512, n_seq_max=1, n_threads=1, n_batch=64)
    # (position, rows) of each call after a 240-token prompt; windows rewind to their start
    plan = [(240, 1), (241, 3), (242, 1), (243, 1), (244, 2), (246, 1), (247, 1), (248, 1),
            (249, 4), (253, 1), (254, 1), (255, 1), (256, 1)]

    def run(pad: int) -> tuple[list[np.ndarray], list[int]]:
        calls: list[int] = []
        with StageEngine(EngineConfig(path, pad_rows=pad, **cfg)) as eng:
            for a in range(0, 240, 64):
                eng.forward([Segment(0, a, tokens=stream[a:min(240, a + 64)], n_logits=0)])
            real = eng._forward
            eng._forward = lambda part: calls.append(sum(x.n_rows for x in part)) or real(part)
            outs = []
            for pos, n in plan:
                outs.append(eng.forward([Segment(0, pos, tokens=stream[pos:pos + n], n_logits=n)],
                                        rewind=True)[0])
                assert eng.next_pos(0) == pos + n
        return outs, calls

    padded, calls = run(2)
    plain, _ = run(1)
    # 2 rows until the 3-row window, then 4 for the three calls after it; the 4-row window
    # renews it, but at 253 and 254 a 4-row call would end past cell 256 where a 2-row
    # step's does not (2 rows), at 255 both end in the next bucket (4 rows)
    assert calls == [2, 4, 4, 4, 4, 2, 2, 2, 4, 2, 2, 4, 2], calls
    for a, b in zip(padded, plain):
        assert np.array_equal(a, b)

    monkeypatch.setenv("MESHNODE_GPU_STICKY_CALLS", "0")   # off: each call at its own width
    _, calls = run(2)
    assert calls == [2, 3, 2, 2, 2, 2, 2, 2, 4, 2, 2, 2, 2], calls


def test_a_padding_engine_widens_only_rows_that_all_reach_the_head(smollm2, monkeypatch):
    """Prompt chunks asking fewer logits than rows neither start wide calls nor run wide
    (the head runs on the rows asking logits, its kernels go by their count); windows and
    one-row steps do, and chunks asking none may; results equal an unpadded engine's."""
    monkeypatch.setenv("MESHNODE_GPU_STICKY_CALLS", "8")
    rng = np.random.default_rng(2)
    stream = rng.integers(3, 2000, size=64, dtype=np.int32)
    # (position, rows, logits): a 3-row chunk asking 1 starts nothing; a window does; then
    # a 2-row chunk asking 1 keeps its width, a 2-row chunk asking none and steps go wide
    plan = [(0, 16, 0), (16, 3, 1), (19, 1, 1), (20, 3, 3), (23, 2, 1), (25, 2, 0), (27, 1, 1)]

    def run(pad: int) -> tuple[list[np.ndarray], list[int]]:
        calls: list[int] = []
        with StageEngine(EngineConfig(smollm2.path, pad_rows=pad, n_ctx=256, n_seq_max=1,
                                      n_threads=1, n_batch=64)) as eng:
            real = eng._forward
            eng._forward = lambda part: calls.append(sum(x.n_rows for x in part)) or real(part)
            outs = [eng.forward([Segment(0, p, tokens=stream[p:p + n], n_logits=k)])[0]
                    for p, n, k in plan]
        return outs, calls

    padded, calls = run(2)
    plain, _ = run(1)
    assert calls == [16, 3, 2, 4, 2, 4, 4], calls
    for a, b in zip(padded, plain):
        assert np.array_equal(a, b)


def test_call_shape_timing_patterns_and_verdict():
    """time_call_shapes runs each pattern (warm calls first, then timed ones) and calls
    wide calls the winner only when a wide step in a run costs less than the mean of a
    narrow step in a run and a step after a change."""
    widths: list[int] = []
    now = [0.0]
    cost = {2: 1e-3, 4: 2e-3}

    def step(rows: int) -> None:
        # a call costs 5 ms more when its width differs from the call before it
        changed = bool(widths) and widths[-1] != rows
        widths.append(rows)
        now[0] += cost[rows] + (5e-3 if changed else 0.0)

    t = time_call_shapes(step, 2, 4, clock=lambda: now[0])
    n = WARM_CALLS + TIMED_CALLS
    assert widths == [2] * n + [4] * n + [(2, 4)[i % 2] for i in range(n)]
    assert (t.narrow, t.wide) == pytest.approx((1.0, 2.0))
    assert t.changing == pytest.approx(6.5)   # median of 6 and 7 ms
    assert t.wide_wins and "alternating 6.50 ms" in t.summary()
    assert not CallShapeTimes(2, 4, 1.0, 2.0, 1.5).wide_wins
    # measured on an H200: SmolLM2's shape wide, an 8B shape narrow (its wide step beats a
    # step after a change, not the mean with a step in a run)
    assert CallShapeTimes(2, 4, 1.56, 1.80, 5.16).wide_wins
    assert not CallShapeTimes(2, 4, 3.84, 4.89, 5.10).wide_wins


def test_an_offloading_engine_chooses_its_sticky_calls_by_timing_itself(smollm2, monkeypatch):
    """Without $MESHNODE_GPU_STICKY_CALLS an engine with offloaded layers and a pad width
    times its call shapes and stays wide GPU_STICKY_CALLS calls only when wide calls win;
    the scratch steps leave no session behind; a CPU engine and a set variable skip the
    timing."""
    monkeypatch.delenv("MESHNODE_GPU_STICKY_CALLS", raising=False)
    with StageEngine(EngineConfig(smollm2.path, pad_rows=2, n_ctx=512, n_seq_max=1,
                                  n_threads=1, n_batch=64)) as eng:
        assert eng.call_shapes is None and eng._sticky_calls == 0   # CPU: not timed
        real = time_call_shapes(eng._scratch_step, 2, 4)   # real steps on this engine
        assert min(real.narrow, real.wide, real.changing) > 0 and eng.sessions() == []
        eng.forward([Segment(0, 0, tokens=np.arange(3, 8, dtype=np.int32), n_logits=1)])
        eng.gpu_layers = 1   # as if offloaded: the verdict follows the timing
        for verdict, calls in ((CallShapeTimes(2, 4, 1.5, 1.8, 4.4), GPU_STICKY_CALLS),
                               (CallShapeTimes(2, 4, 3.6, 4.9, 4.7), 0)):
            monkeypatch.setattr(stage_mod, "time_call_shapes", lambda *a, v=verdict, **k: v)
            assert eng._choose_sticky_calls("m") == calls
        monkeypatch.setenv("MESHNODE_GPU_STICKY_CALLS", "5")
        assert eng._choose_sticky_calls("m") == 5
        monkeypatch.setenv("MESHNODE_GPU_STICKY_CALLS", "lots")   # not a number: timing
        assert eng._choose_sticky_calls("m") == 0
        assert eng.sessions() == [0] and eng.next_pos(0) == 5


@pytest.mark.parametrize(("a", "b"), [(0, 15), (15, 30)])
def test_call_shape_steps_run_on_every_kind_of_slice(smollm2, tmp_path, a, b):
    """The scratch steps an engine times at load run on a first slice (tokens, no head) and
    a final one (hidden states, the head), padded and not, and leave nothing behind."""
    from meshnode.models.slicer import stage_role, write_slice

    role = stage_role(a, b, 30)
    dest = tmp_path / f"s{a}.gguf"
    write_slice(smollm2.path, a, b, dest, keep_embedding=role.keep_embedding, keep_head=role.keep_head)
    with StageEngine(EngineConfig(dest, pad_rows=2, n_ctx=256, n_seq_max=1, n_threads=1, n_batch=64,
                                  takes_tokens=role.keep_embedding, has_head=role.keep_head)) as eng:
        t = time_call_shapes(eng._scratch_step, 2, 4)
        eng._scratch_step(1)
        assert min(t.narrow, t.wide, t.changing) > 0 and eng.sessions() == []
