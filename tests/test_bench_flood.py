"""`meshnode bench flood` (issue #17, "Show"): a stranger floods a node that serves a
model, and the command says whether its memory, its member's link and its answers held.

The slow test runs the real command: a victim node process serving the default model
(SmolLM2) split over it and a member, a client sending greedy chat completions before
and during the flood, and the stranger's QUIC connections from the test's process
tree. The fast tests check the verdict's rules and the options.
"""

from __future__ import annotations

import re

import pytest

from meshnode.bench.flood_bench import verdict
from tests.nodeproc import meshnode_cmd


def _results(**kw) -> dict:
    res = {"rss_peak_growth_mb": 3.0, "requests_failed": 0, "link_unchanged": True, "victim_alive": True,
           "serving": {"answers_identical": True}}
    res.update(kw)
    return res


@pytest.mark.parametrize("change, phrase", [
    ({}, None),
    ({"rss_peak_growth_mb": 50.1}, "memory grew 50.1 MB > 50 MB"),
    ({"requests_failed": 2}, "2 request(s) failed"),
    ({"serving": {"answers_identical": False}}, "a greedy answer changed"),
    ({"link_unchanged": False}, "the member's link was lost"),
    ({"victim_alive": False}, "the victim exited"),
])
def test_the_verdict_fails_on_memory_requests_answers_link_or_a_dead_victim(change, phrase):
    failures = verdict(_results(**change), 50.0)
    assert failures == ([phrase] if phrase else [])


@pytest.mark.parametrize("args", [
    ["--split", "3"], ["--requests", "0"], ["--max-tokens", "0"], ["--connections", "0"],
])
def test_bad_flood_options_are_refused_up_front(tmp_path, args, meshnode_main):
    r = meshnode_main("--home", str(tmp_path), "bench", "flood", *args)
    assert r.returncode == 2
    assert "error: argument" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "data").exists()   # no model was fetched or written


@pytest.mark.slow
def test_bench_flood_reports_serving_unaffected(tmp_path, smollm2):
    r = meshnode_cmd("--home", str(tmp_path), "bench", "flood", "--model", str(smollm2.path),
                     "--connections", "20", "--duration", "5", "--requests", "3", timeout=240)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr[-3000:]
    assert "verdict: OK" in out
    assert f"serving {smollm2.path.stem}" in out or smollm2.name in out
    assert "2 stages, the second on the member" in out
    # the node may refuse some handshakes outright (its limit on handshakes in flight); it
    # closes every connection it accepted
    m = re.search(r"connected (\d+), refused before QUIC (\d+), closed by the node (\d+)", out)
    assert m and int(m[1]) + int(m[2]) == 20 and m[3] == m[1], out
    assert "member link: unchanged, authenticated" in out
    phases = dict(re.findall(r"(before|during|after) the flood: +(\d+ ok, \d+ failed)", out))
    assert phases["before"] == phases["after"] == "3 ok, 0 failed", out
    assert re.fullmatch(r"[1-9]\d* ok, 0 failed", phases["during"]), out
    assert "identical in every request" in out
