"""Benchmark options are checked before any work starts (one-line errors, exit 2).

The checks run :func:`meshnode.cli.main` in this process; the ``slow`` tests run the real
``meshnode`` command, so that a user's mistake stays one line and exit 2 there too.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("args", [
    ["bench", "spec", "--target-quant", "Q9"],
    ["bench", "spec", "--draft-quant", "half"],
    ["bench", "spec", "--draft-layers", "0"],
    ["bench", "serve", "--rounds", "0"],
    ["bench", "serve", "--temperature", "-1"],
    ["bench", "serve", "--cuda-devices", "0,gpu1"],
    ["bench", "engine", "--gap-ms", "-1"],
    ["bench", "engine", "--gap-ms", "soon"],
    ["bench", "engine", "--windows", "0,3"],
    ["bench", "engine", "--windows", "four"],
    ["bench", "replay", "--max-n", "0,4"],
    ["bench", "replay", "--max-n", "four"],
    ["bench", "replay", "--hop-ms", "-3"],
    ["bench", "replay", "--step-ms", "3:17"],
    ["bench", "replay", "--step-ms", "0:fast"],
    ["bench", "replay", "--min-match", "0"],
    ["bench", "replay", "--max-window", "0"],
    ["bench", "replay", "--proposers", "ngram,oracle"],
    ["bench", "replay", "--set", "half"],
    ["bench", "spec", "--set", "everything"],
    ["bench", "spec", "--ctx", "0"],
    ["bench", "prefix", "--rounds", "0"],
    ["bench", "prefix", "--spec-mode", "maybe"],
    ["bench", "net", "--iters", "0"],
    ["bench", "net", "--bulk-rows", "x"],
    ["bench", "sample", "--iters", "0"],
    ["bench", "spec", "--delay-ms", "-1"],
    ["bench", "spec", "--draft-max", "33"],
    ["bench", "spec", "--delay-ms", "nan"],
    ["bench", "prefix", "--delay-ms", "inf"],
    ["bench", "score", "--prompts", "0"],
    ["bench", "score", "--delay-ms", "-2"],
    ["bench", "score", "--gpu-layers", "most"],
    ["bench", "prefix", "--gpu-layers", "-3"],
    ["bench", "spec", "--repetition-penalty", "0"],
    ["bench", "spec", "--repetition-penalty", "11"],
    ["bench", "spec", "--repetition-penalty", "high"],
    ["bench", "soak", "--minutes", "nan"],
    ["bench", "soak", "--down", "-5"],
    ["bench", "soak", "--spare", "-1"],
    ["bench", "engine", "--threads", "0"],
    ["status", "--timeout", "0"],
    ["mesh", "rotate", "--timeout", "-1"],
])
def test_bad_benchmark_options_are_refused_up_front(tmp_path, args, meshnode_main):
    r = meshnode_main("--home", str(tmp_path), *args)
    assert r.returncode == 2
    assert "error: argument" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "data").exists()   # nothing was fetched or derived


@pytest.mark.slow
def test_a_truncated_draft_must_keep_fewer_layers_than_the_model(tmp_path, smollm2):
    r = subprocess.run([sys.executable, "-m", "meshnode", "--home", str(tmp_path), "bench", "spec",
                        "--model", str(smollm2.path), "--draft-layers", str(smollm2.n_layers)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert f"has {smollm2.n_layers} layers" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("sizes", ["abc", "500", ""])
def test_bench_net_refuses_bad_datagram_sizes(tmp_path, sizes, meshnode_main):
    r = meshnode_main("--home", str(tmp_path), "bench", "net", "--datagram-sizes", sizes)
    assert r.returncode == 2
    assert "--datagram-sizes takes" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["bench", "net", "--iters", "0"], "error: argument"),          # refused by the parser
    (["bench", "net", "--datagram-sizes", "500"], "--datagram-sizes takes"),   # by the benchmark
])
def test_the_meshnode_command_refuses_bad_benchmark_options(tmp_path, args, message):
    r = subprocess.run([sys.executable, "-m", "meshnode", "--home", str(tmp_path), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert message in r.stderr.strip().splitlines()[-1]   # one line says what is wrong


@pytest.mark.slow
def test_bench_sample_times_every_setting_against_greedy(tmp_path, synthetic_gguf):
    model = synthetic_gguf("tiny.gguf", n_layer=2, vocab=4096)
    r = subprocess.run([sys.executable, "-m", "meshnode", "--home", str(tmp_path), "bench", "sample",
                        "--model", str(model), "--iters", "3", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["vocab"] == 4096
    assert set(res["us"]) == {"code", "story", "question", "random"}
    for by in res["us"].values():
        assert set(by) == {"greedy", "T=0.7", "T=0.7 top_p=0.9", "T=1 top_p=0.95", "T=0.7 top_k=40",
                           "presence+freq", "repeat last 64", "repetition all"}
        assert all(us > 0 for us in by.values())
    assert "ratio against greedy" in r.stdout


class _Response:   # what sse_chunks reads of an httpx streaming response
    status_code = 400
    text = '{"error":{"message":"This model\'s maximum context length is 1024 tokens."}}'

    def read(self) -> bytes:
        return self.text.encode()


def test_an_http_error_from_a_node_is_a_benchmark_error():
    from meshnode.bench.cluster import sse_chunks
    from meshnode.bench.errors import BenchError
    from meshnode.errors import MeshnodeError

    with pytest.raises(BenchError, match="HTTP 400 from the node: .*maximum context length") as info:
        list(sse_chunks(_Response()))
    assert isinstance(info.value, MeshnodeError)   # the CLI prints it as one line


@pytest.mark.slow
def test_a_prompt_longer_than_the_models_context_stops_bench_serve_with_one_line(tmp_path, synthetic_gguf):
    # bench serve's long prompt is ~1200 tokens of a 320-token vocabulary: more than the
    # nodes' 1024-token context. The node's 400 reaches the user as one line, not a traceback.
    model = synthetic_gguf("tiny.gguf", n_layer=2)
    r = subprocess.run([sys.executable, "-m", "meshnode", "--home", str(tmp_path), "bench", "serve",
                        "--model", str(model), "--stages", "1", "--rounds", "1", "--tokens", "2"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("meshnode: error: HTTP 400 from the node") and "maximum context length" in last


def test_bench_soak_keeps_logs_only_in_an_empty_directory(tmp_path, meshnode_main):
    used = tmp_path / "logs"
    used.mkdir()
    (used / "node0").mkdir()   # an earlier run's homes: its identities must not be reused
    r = meshnode_main("--home", str(tmp_path), "bench", "soak", "--keep", str(used))
    assert r.returncode == 2
    assert "not an empty directory" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "data").exists()   # refused before the model was looked for
