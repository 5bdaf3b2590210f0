"""`meshnode bench report`'s rendering: canned benchmark JSON in, markdown and SVG out."""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET

import pytest

from meshnode.bench import report

ENGINE = {
    "model": "smollm2-135m-instruct-q4_1", "n_layers": 30, "splits": [10, 20], "threads": 2,
    "batch": 64, "tokens": 32, "prefill_tokens": 128, "loadavg": [0.3, 0.6, 1.4],
    "decode_ms_per_token": {"whole": 10.37, "chain": 10.71, "ratio": 1.032},
    "prefill_tokens_per_s": {"whole": 363.8, "chain": 361.1, "ratio": 0.992},
    "decode_stage_ms": [2.83, 2.80, 5.04], "prefill_stage_ms_per_chunk": [59.7, 59.1, 57.2],
    "chain_logits_identical": True,
    "idle_gap": {"gap_ms": 12.0, "back_to_back": 10.48, "after_gap": 10.59, "ratio": 1.01},
}


def _stage(decode, ratio, agg):
    return {"decode_tok_s": decode, "ttft_ms": 80.0, "prefill_tok_s": 300.0, "prefill_tokens": 480,
            "aggregate_tok_s": {"1": agg, "4": 2 * agg}, "decode_ratio": ratio,
            "decode_ratio_range": [ratio - 0.02, ratio + 0.01],
            "aggregate_over_ceiling": {"1": 0.9, "4": 0.8}}


SERVE = {"smollm2-135m-instruct-q4_1": {
    "rounds": 2, "ceiling_tok_s": {"1": 70.0, "4": 160.0},
    "1": _stage(60.0, 1.0, 58.0), "2": _stage(55.0, 0.92, 50.0), "3": _stage(50.0, 0.84, 45.0),
    "token_path": {"1": {"layers": [[0, 30]], "steps": 30, "total_us": 16000.0,
                         "pieces": [["compute", 15000.0], ["between steps", 1000.0]]},
                   "2": {"layers": [[0, 15], [15, 30]], "steps": 29, "total_us": 18000.4,
                         "pieces": [["s0 compute", 7000.0], ["hop to s1", 200.0], ["s1 compute", 9000.0]]},
                   "3": {"layers": [[0, 10], [10, 20], [20, 30]]}}}}


def _strategy(tok_s, acc, speedup, same=True):
    return {"tok_s": tok_s, "acceptance": acc, "speedup": speedup, "draft_n": 100 if acc else 0,
            "draft_n_accepted": int(100 * acc), "windows": 10, "ms_per_window": 50.0,
            "plain_steps": 20, "ms_per_plain_step": 30.0, "lookahead": 0, "lookahead_used": 0,
            "tokens": 192, "same_text_as_baseline": same,
            "wall_tok_s": tok_s * 0.8, "wall_speedup": 1 + (speedup - 1) * 0.75, "ttft_ms": 1500.0}


SPEC = {"code_edit": {"baseline": _strategy(21.4, 0.0, 1.0), "ngram_auto": _strategy(38.6, 0.75, 1.8),
                      "draft": _strategy(22.0, 0.9, 1.02)},
        "mixed_chat": {"baseline": _strategy(24.0, 0.0, 1.0), "ngram_auto": _strategy(24.9, 0.0, 1.04),
                       "draft": _strategy(16.5, 0.49, 0.68, same=False)}}

NET = [{"datagram": 1350, "rtt": {"576 x f32": {"median_ms": 0.379, "p90_ms": 0.45}},
        "bulk": {"4096-wide f32": 17.5}},
       {"datagram": 16384, "rtt": {"576 x f32": {"median_ms": 0.305, "p90_ms": 0.4}},
        "bulk": {"4096-wide f32": 49.0}}]

MACHINE = {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "ram_gib": 23.5, "os": "Linux-6.1-x86_64",
           "python": "3.11.7", "llama_cpp_python": "0.3.36", "meshnode": "0.1.0", "commit": "abc1234",
           "date": "2026-11-27 13:50 UTC", "loadavg_before": [0.2, 0.5, 1.0],
           "loadavg_after": [1.9, 1.2, 1.1]}


def _results(**over):
    r = {"machine": MACHINE, "quick": True, "seconds": {"engine": 8, "serve": 100, "spec": 200, "net": 2},
         "commands": {"engine": "meshnode bench engine --tokens 32 --json", "serve": "meshnode bench serve --quick --json",
                      "spec": "meshnode bench spec --quick --json", "net": "meshnode bench net --json"},
         "benchmarks": {"engine": ENGINE, "serve": SERVE, "spec": SPEC, "net": NET}, "errors": {}}
    r.update(over)
    return r


def test_machine_section_describes_the_machine():
    md, _ = report.render(_results())
    for text in ("Intel(R) Xeon(R) Processor, 2 core(s)", "23.5 GiB", "Linux-6.1-x86_64", "Python 3.11.7",
                 "llama-cpp-python 0.3.36", "commit abc1234", "2026-11-27 13:50 UTC",
                 "0.20 / 0.50 / 1.00 before, 1.90 / 1.20 / 1.10 after", "310 s in all",
                 "`meshnode bench report --quick`"):
        assert text in md, text


def test_every_benchmark_has_its_command_table_and_reading():
    md, _ = report.render(_results())
    for cmd in _results()["commands"].values():
        assert f"$ {cmd}\n" in md
    assert md.count("How to read it:") == 4
    assert "| decode ms/token | 10.37 | 10.71 | 1.032 |" in md
    assert "| 2 | 55.0 | 0.92x | 0.90-0.93 | 80 | 300.0 | 50.0 (0.90) | 100.0 (0.80) |" in md
    assert "| code_edit | ngram_auto | 30.9 | 1.60x | 1500 | 38.6 | 1.80x | 0.75 | 100 | yes |" in md
    assert "| mixed_chat | draft | 13.2 | 0.76x | 1500 | 16.5 | 0.68x | 0.49 | 100 | **NO** |" in md  # a mismatch stands out
    assert "| 576 x f32 | 0.379 | 0.305 |" in md
    assert "- 2 stage(s): 18000 us (median of 29 steps) = s0 compute 7000 + hop to s1 200 + s1 compute 9000\n" in md
    assert "- 3 stage(s)" not in md                                             # nothing marked: no line
    assert "\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n" in md  # workload and strategy are text: left


def test_charts_are_well_formed_svg_and_linked():
    md, svgs = report.render(_results(), charts_rel="bench")
    assert set(svgs) == {"decode.svg", "acceptance.svg", "prefill.svg", "concurrency.svg"}
    for name, text in svgs.items():
        root = ET.fromstring(text)
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        bars = [e for e in root.iter("{http://www.w3.org/2000/svg}rect")][1:]  # the first is the background
        assert bars and all(float(b.get("width")) >= 0 for b in bars)
        assert f"](bench/{name})" in md
    decode = ET.fromstring(svgs["decode.svg"])
    labels = [t.text for t in decode.iter("{http://www.w3.org/2000/svg}text")]
    assert "1 node" in labels and "3-stage split" in labels
    assert "2 stages + 5 ms, n-gram, code_edit" in labels


def test_bar_lengths_are_proportional_and_labels_escaped():
    svg = report.bar_chart("a <b> & c", "unit", [("x<y", 10.0, 0), ("z", 5.0, 1)])
    root = ET.fromstring(svg)  # escaped, or this raises
    widths = [float(r.get("width")) for r in root.iter("{http://www.w3.org/2000/svg}rect")][1:]
    assert widths[0] == pytest.approx(2 * widths[1])


def test_a_failed_or_missing_benchmark_is_reported_not_fatal():
    r = _results(errors={"spec": "exit status 1"})
    del r["benchmarks"]["spec"]
    del r["benchmarks"]["net"]
    del r["commands"]["net"]
    md, svgs = report.render(r)
    assert "Did not complete: exit status 1." in md
    assert "Network" not in md
    assert "acceptance.svg" not in svgs and "decode.svg" in svgs


def test_splice_keeps_the_hand_written_reference():
    doc = f"# Benchmarks\n\nintro\n\n{report.BEGIN}\nold numbers\n{report.END}\n\n## Reference\n\nkept\n"
    out = report.splice(doc, "new numbers\n")
    assert "old numbers" not in out and "new numbers" in out
    assert out.startswith("# Benchmarks\n\nintro\n") and out.endswith("## Reference\n\nkept\n")
    assert report.splice("", "x\n").count(report.BEGIN) == 1


def test_from_json_writes_markdown_and_charts(tmp_path):
    src = tmp_path / "results.json"
    src.write_text(json.dumps(_results()))
    out = tmp_path / "docs" / "benchmarks.md"
    args = argparse.Namespace(quick=False, out=str(out), charts=str(tmp_path / "docs" / "bench"),
                              only="engine,net,serve,spec", from_json=str(src))
    assert report.run(args) == 0
    assert "](bench/decode.svg)" in out.read_text()
    assert sorted(p.name for p in (tmp_path / "docs" / "bench").iterdir()) == [
        "acceptance.svg", "concurrency.svg", "decode.svg", "prefill.svg"]


def test_parse_json_takes_the_last_line_or_the_whole_output():
    assert report._parse_json('progress\n{"a": 1}\n') == {"a": 1}
    assert report._parse_json('[\n {"a": 1}\n]\n') == [{"a": 1}]
    with pytest.raises(ValueError):
        report._parse_json("no json here\n")


def test_machine_info_reads_this_machine(monkeypatch):
    monkeypatch.setattr(report, "_commit", lambda: None)  # git is a process: not in the fast tier
    m = report.machine_info()
    assert m["cores"] >= 1 and m["python"] and len(m["loadavg_before"]) == 3


@pytest.mark.parametrize("args, message", [
    (["--only", "engine,flood"], "--only takes some of engine,net,serve,spec"),
    (["--from-json", "missing.json"], "cannot read missing.json"),
    # checked before the suite runs (for many minutes), not when its results are written
    (["--out", "."], ".: a directory, not a file"),
    (["--charts", "a-file"], "a-file: not a directory"),
    (["--out", "a-file/benchmarks.md"], "a-file/benchmarks.md: cannot write in a-file"),
])
def test_bad_report_options_are_one_line_and_write_nothing(tmp_path, monkeypatch, args, message, meshnode_main):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("x")
    r = meshnode_main("--home", str(tmp_path / "home"), "bench", "report", *args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "docs").exists()


@pytest.mark.slow
def test_the_command_runs_a_benchmark_and_splices_its_results(tmp_path):
    """`bench net` needs no model: the cheap end-to-end path (subprocess, JSON, splice)."""
    import subprocess
    import sys

    out = tmp_path / "benchmarks.md"
    out.write_text(f"# B\n\nintro\n\n{report.BEGIN}\nold\n{report.END}\n\n## Reference\n")
    r = subprocess.run([sys.executable, "-m", "meshnode", "--home", str(tmp_path / "home"), "bench", "report",
                        "--quick", "--only", "net", "--out", str(out), "--charts", str(tmp_path / "bench")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    md = out.read_text()
    assert md.startswith("# B\n\nintro\n") and md.endswith("## Reference\n") and "old" not in md
    assert "$ meshnode bench net --iters 50 --bulk-mb 8 --json" in md and "| 576 x f32 lane |" in md
    saved = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert saved["quick"] and saved["benchmarks"]["net"][0]["datagram"] == 1350


def test_spec_results_saved_before_wall_clock_still_render():
    # `--from-json` of a results.json written before wall clock was measured: dashes
    from meshnode.bench.report import _spec

    old = {k: v for k, v in _strategy(38.6, 0.75, 1.8).items() if k not in ("wall_tok_s", "wall_speedup", "ttft_ms")}
    assert "| code_edit | ngram_auto | - | - | - | 38.6 | 1.80x | 0.75 | 100 | yes |" in _spec({"code_edit": {"ngram_auto": old}})
