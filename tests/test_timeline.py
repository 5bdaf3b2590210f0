"""The token-path timeline (meshnode.timeline, meshnode.bench.timeline).

Unit tests follow the analysis on hand-made marks; the slow test runs ``meshnode bench
serve`` on real node processes (llama.cpp, QUIC, the fast lane) and checks
that the marked path accounts for the decode speed the bench measured."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshnode import timeline
from meshnode.bench.timeline import TokenPath, load_marks, token_path

US = 1000   # marks are in ns


def _span(tag: str, a: int, b: int) -> list[tuple[int, str]]:
    return [(a * US, tag + "<"), (b * US, tag + ">")]


def _split_step(t: int, *, early_receive: bool = False) -> tuple[list, list]:
    """One lane step of a 2-stage split starting at ``t`` us: 1000 us of compute on stage
    0, 2000 on stage 1, known gaps; its next step's compute starts at t + 3600."""
    s0 = _span("dec", t, t + 1000) + _span("send", t + 1050, t + 1100)
    rx = t + 1080 if early_receive else t + 1150      # stage 1 may start inside the sendto
    s1 = (_span("recv", rx, rx + 50) + _span("dec", rx + 100, rx + 2100)
          + _span("send", rx + 2150, rx + 2200))
    s0 += _span("recv", t + 3400, t + 3450)
    return s0, s1


def test_a_split_step_is_cut_into_pieces_that_add_up_to_it():
    s0, s1 = [], []
    for k in range(5):
        a, b = _split_step(10_000 * k, early_receive=k % 2 == 1)
        s0 += a
        s1 += b
    s0 += _span("dec", 50_000, 51_000)                     # the last step's successor
    tp = token_path([sorted(s0), sorted(s1)])
    assert tp is not None and tp.steps == 5
    pieces = dict(tp.pieces)
    assert list(pieces) == ["s0 compute", "s0 to send", "hop to s1", "s1 receive", "s1 queue", "s1 compute",
                            "s1 to send", "hop to s0", "s0 receive", "s0 to next step"]
    assert pieces["s0 compute"] == 1000 and pieces["s1 compute"] == 2000
    assert pieces["s0 to send"] == 50 and pieces["s1 receive"] == 50 and pieces["s0 receive"] == 50


def test_steps_add_up_and_early_receives_are_hops_from_the_send():
    s0, s1 = _split_step(0, early_receive=True)
    s0 += _span("dec", 10_000, 11_000)
    tp = token_path([sorted(s0), sorted(s1)])
    assert tp is not None and tp.steps == 1
    assert tp.total_us == 10_000
    assert sum(us for _, us in tp.pieces) == tp.total_us
    assert dict(tp.pieces)["hop to s1"] == 30               # from the sendto's start


def test_prefill_chunks_and_steps_outside_the_windows_are_left_out():
    s0, s1 = _split_step(0)
    s0 += _span("dec", 5_000, 9_000)                         # a prefill chunk: sent over a stream, no lane marks
    s1 += _span("dec", 9_500, 12_000)
    a, b = _split_step(20_000)
    s0 += a + _span("dec", 30_000, 31_000)
    s1 += b
    both = token_path([sorted(s0), sorted(s1)])
    assert both is not None and both.steps == 2              # step 0 (next: the chunk) and step 20 ms
    assert token_path([sorted(s0), sorted(s1)], windows=[(19_000 * US, 21_000 * US)]).steps == 1
    assert token_path([sorted(s0), sorted(s1)], windows=[(40_000 * US, 41_000 * US)]) is None


def test_a_lost_frame_is_not_a_step():
    s0 = _span("dec", 0, 1000) + _span("send", 1050, 1100) + _span("dec", 60_000, 61_000)
    s1: list = []                                            # stage 1 never saw it
    assert token_path([s0, s1]) is None


def test_one_node_steps_are_compute_and_the_time_between():
    marks = _span("dec", 0, 800) + _span("dec", 1000, 1800) + _span("dec", 2100, 2900)
    tp = token_path([marks])
    assert tp is not None and tp.steps == 2
    assert dict(tp.pieces) == {"compute": 800, "between steps": 250}


def test_a_token_path_survives_json():
    tp = TokenPath(3, 1234.5, [("compute", 1000.0), ("between steps", 234.5)])
    again = TokenPath.from_dict(json.loads(json.dumps(tp.as_dict())))
    assert again == tp
    assert again.line().startswith("1234 us (median of 3 steps) = compute 1000 + between steps 234")


def test_the_recorder_is_bounded_and_its_marks_load_back(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline, "MAX_MARKS", 3)
    rec = timeline.Recorder()
    for tag in ("dec<", "dec>", "send<", "send>"):
        rec.mark(tag)
    assert [k for _, k in rec.marks] == ["dec<", "dec>", "send<"] and rec.dropped == 1
    rec.dump(tmp_path / "node0")
    (tmp_path / "node0" / "999.json").write_text("{not json")       # a node killed mid-write
    assert [k for _, k in load_marks(tmp_path / "node0")] == ["dec<", "dec>", "send<"]
    assert load_marks(tmp_path / "missing") == []


def test_off_unless_the_variable_names_a_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(timeline.ENV, raising=False)
    assert timeline._from_env() is None
    at_exit = []
    monkeypatch.setattr(timeline.atexit, "register", lambda fn, *a: at_exit.append((fn, a)))
    monkeypatch.setenv(timeline.ENV, str(tmp_path / "marks"))
    rec = timeline._from_env()
    assert rec is not None
    rec.mark("dec<")
    fn, a = at_exit[0]
    fn(*a)                                                   # what the process does when it exits
    assert [k for _, k in load_marks(tmp_path / "marks")] == ["dec<"]


@pytest.mark.slow
@pytest.mark.net
def test_bench_serve_token_path_accounts_for_a_real_split(tmp_path, synthetic_gguf):
    model = synthetic_gguf("tiny.gguf", n_layer=4, n_embd=256, n_head=4, n_kv_head=2, n_ff=512, vocab=1024)
    r = subprocess.run([sys.executable, "-m", "meshnode", "--home", str(tmp_path / "home"), "bench", "serve",
                        "--model", str(model), "--stages", "1,2", "--concurrency", "1", "--tokens", "40",
                        "--rounds", "1", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = next(iter(json.loads(r.stdout.strip().splitlines()[-1]).values()))
    assert "where a one-stream decode token's time goes" in r.stdout
    for n in ("1", "2"):
        tl = res["token_path"][n]
        assert tl["steps"] >= 30                  # (nearly) every decode step of the 40-token stream
        assert all(us >= 0 for _, us in tl["pieces"])
        # the marked step is the decode speed the client saw (within the noise of a busy machine)
        assert 0.5 < tl["total_us"] / (1e6 / res[n]["decode_tok_s"]) < 2.0
    # two contiguous ranges over the 4 layers (where the cut falls follows the nodes'
    # measured speeds, which a busy machine moves)
    (a0, a1), (b0, b1) = res["token_path"]["2"]["layers"]
    assert a0 == 0 < a1 == b0 < b1 == 4
    names = [name for name, _ in res["token_path"]["2"]["pieces"]]
    assert names[0] == "s0 compute" and "s1 compute" in names and names[-1] == "s0 to next step"
