"""GPU offload: ``--gpu-layers`` parsing, the ``auto`` rule, the value llama.cpp is given,
and its way through real node processes to every engine a node builds.

CI has no GPU, so a fake device list stands in for a CUDA build where the resolution
needs one (``offload.gpu_devices``); what llama.cpp receives is read from the real
``llama_model_params`` passed to ``llama_model_load_from_file``. The tests that need
CUDA itself skip without it.
"""

from __future__ import annotations

import argparse
import re

import pytest

import llama_cpp

from meshnode import argtypes
from meshnode.engine import EngineConfig, ModelLoadError, StageEngine
from meshnode.engine import offload
from meshnode.mesh.planner import Candidate, ModelShape, plan
from tests.nodeproc import wait_for

GIB = 1 << 30

cuda_only = pytest.mark.skipif(not llama_cpp.llama_supports_gpu_offload(),
                               reason="needs a GPU build of llama.cpp")


# ---- the option ---------------------------------------------------------------------


def test_gpu_layers_words_and_numbers():
    assert argtypes.gpu_layers("auto") == offload.GPU_LAYERS_AUTO
    assert argtypes.gpu_layers("ALL") == offload.GPU_LAYERS_ALL
    assert argtypes.gpu_layers("0") == 0
    assert argtypes.gpu_layers("12") == 12
    for bad in ("-3", "lots", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            argtypes.gpu_layers(bad)


def test_a_bad_gpu_layers_value_is_one_line(tmp_path, meshnode_main):
    r = meshnode_main("--home", str(tmp_path), "serve", "--headless", "--gpu-layers", "many")
    assert r.returncode == 2
    assert "argument --gpu-layers" in r.stderr and "Traceback" not in r.stderr


# ---- the auto rule (pure) -------------------------------------------------------------


def test_auto_offloads_everything_that_fits():
    # 4 GB over 32 layers (+2 for embeddings and head), 64 MB of KV per layer, 24 GB free
    assert offload.auto_layers(file_bytes=4 * GIB, n_layer=32, kv_bytes_per_layer=64 << 20,
                               free_vram=24 * GIB) == 33   # every layer and the head


def test_auto_offloads_the_layers_that_fit_and_no_more():
    n = offload.auto_layers(file_bytes=16 * GIB, n_layer=32, kv_bytes_per_layer=0,
                            free_vram=8 * GIB, reserve=0)
    per_layer = 16 * GIB / 34
    assert n == int(8 * GIB // per_layer) and 0 < n < 32
    assert offload.auto_layers(file_bytes=16 * GIB, n_layer=32, kv_bytes_per_layer=0,
                               free_vram=GIB // 4) == 0   # below the reserve: nothing
    assert offload.auto_layers(file_bytes=GIB, n_layer=8, kv_bytes_per_layer=0, free_vram=0) == 0


def test_without_a_gpu_every_request_resolves_to_zero(monkeypatch):
    monkeypatch.setattr(offload, "gpu_devices", lambda: [])
    for requested in (offload.GPU_LAYERS_AUTO, offload.GPU_LAYERS_ALL, 5):
        assert offload.resolve_gpu_layers(requested, file_bytes=GIB, shape=lambda: (8, 0)) == 0


# ---- the value llama.cpp is given -------------------------------------------------------


def _fake_gpu(monkeypatch, free: int) -> None:
    dev = offload.GpuDevice("CUDA0", "fake", "cuda", free, free)
    monkeypatch.setattr(offload, "gpu_devices", lambda: [dev])


def _passed_gpu_layers(monkeypatch, path, gpu_layers: int) -> int:
    """The n_gpu_layers of the llama_model_params the engine hands llama.cpp (the load is
    stopped there: nothing is loaded)."""
    seen = []
    real = llama_cpp.llama_model_load_from_file

    def spy(path_b, mparams):
        if mparams.vocab_only:   # the auto rule reading the header
            return real(path_b, mparams)
        seen.append(mparams.n_gpu_layers)
        return None

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", spy)
    with pytest.raises(ModelLoadError):
        StageEngine(EngineConfig(path, gpu_layers=gpu_layers, n_ctx=64, n_seq_max=1))
    assert len(seen) == 1
    return seen[0]


@pytest.mark.slow   # the auto rule reads the GGUF header and vocabulary through llama.cpp
def test_the_gpu_layers_reach_llama_cpps_model_params(monkeypatch, synthetic_gguf):
    path = synthetic_gguf(n_layer=6)
    _fake_gpu(monkeypatch, 64 * GIB)
    assert _passed_gpu_layers(monkeypatch, path, 4) == 4
    assert _passed_gpu_layers(monkeypatch, path, offload.GPU_LAYERS_ALL) == offload.GPU_LAYERS_ALL
    assert _passed_gpu_layers(monkeypatch, path, offload.GPU_LAYERS_AUTO) == 7
    assert _passed_gpu_layers(monkeypatch, path, 0) == 0
    monkeypatch.setattr(offload, "gpu_devices", lambda: [])    # a CPU build: never offload
    assert _passed_gpu_layers(monkeypatch, path, 4) == 0


def test_the_gpu_layers_reach_llama_cpp_without_a_model_load(monkeypatch, tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    _fake_gpu(monkeypatch, 64 * GIB)
    assert _passed_gpu_layers(monkeypatch, path, 9) == 9


def test_the_auto_rule_reads_the_shape_from_the_header_and_refuses_a_cut_file(synthetic_gguf, tmp_path):
    from meshnode.engine.stage import _peek_shape

    path = synthetic_gguf(n_layer=6, n_embd=64, n_head=4, n_kv_head=2)
    # 6 layers; K and V in f16 of n_embd * n_kv_head / n_head = 32 values per cell
    assert _peek_shape(path, 100) == (6, 2 * 2 * 32 * 100)
    data = path.read_bytes()
    for keep in (40, len(data) // 3):
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(ModelLoadError, match="cannot read the layer sizes"):
            _peek_shape(cut, 100)


def test_a_stage_wholly_on_the_gpu_defaults_to_one_cpu_thread():
    from meshnode.engine.stage import default_threads, stage_threads

    assert stage_threads(None, gpu_layers=7, n_layer=6) == 1        # every layer and the head
    assert stage_threads(None, gpu_layers=6, n_layer=6) == default_threads()   # head on the CPU
    assert stage_threads(None, gpu_layers=0, n_layer=6) == default_threads()
    assert stage_threads(3, gpu_layers=7, n_layer=6) == 3            # --threads wins


# ---- the planner: VRAM is capacity, and fast ------------------------------------------------


def _shape(n=20, layer=GIB // 2):
    return ModelShape(n_layers=n, layer_bytes=layer, embed_bytes=0, head_bytes=0, n_embd=64, n_ctx=16)


def test_vram_counts_as_memory_a_gpu_node_can_hold():
    cands = [Candidate("a", "a", 4 * GIB, speed=10.0, is_coordinator=True),
             Candidate("b", "b", 2 * GIB, speed=10.0, free_vram=8 * GIB)]
    p = plan(_shape(), cands)
    assert [s.node_id for s in p.stages] == ["a", "b"]
    # without its VRAM, b could not take the layers a cannot hold
    with pytest.raises(Exception):
        plan(_shape(), [cands[0], Candidate("b", "b", 2 * GIB, speed=10.0)])


def test_layers_go_to_the_gpu_node_in_proportion_to_its_vram_speed():
    cands = [Candidate("a", "a", 6 * GIB, speed=10.0, is_coordinator=True),
             Candidate("b", "b", 16 * GIB, speed=10.0)]
    even = plan(_shape(), cands, split=2)
    gpu = plan(_shape(), [cands[0], Candidate("b", "b", 16 * GIB, speed=10.0, free_vram=16 * GIB,
                                              vram_speed=90.0)], split=2)
    assert even.stages[0].n_layers == 10
    assert gpu.stages[0].n_layers == 2        # 20 * 10 / (10 + 90)
    assert gpu.est_ms < even.est_ms


def test_a_gpu_node_whose_vram_holds_few_layers_gets_the_rest_at_cpu_speed():
    shape = _shape()
    small = Candidate("b", "b", 16 * GIB, speed=10.0, free_vram=int(1.1 * 2 * GIB), vram_speed=1000.0)
    p = plan(shape, [Candidate("a", "a", 16 * GIB, speed=10.0, is_coordinator=True), small], split=2)
    # b's VRAM holds ~4 layers; they are nearly free, the other 16 split evenly
    assert 11 <= p.stages[1].n_layers <= 13


# ---- real processes: the node's own setting reaches every engine it builds ------------------


@pytest.mark.slow
def test_each_node_loads_with_its_own_gpu_layers(synthetic_gguf):
    from meshnode.bench.cluster import LocalCluster

    path = synthetic_gguf(n_layer=4)
    with LocalCluster(path, 2) as cluster:
        server = cluster.start(1, "--no-model", "--threads", "1", "--gpu-layers", "3",
                               env={"MESHNODE_GPU_PAD_ROWS": "6"})
        coord = cluster.start(0, "--model", str(path), "--split", "2", "--threads", "1", "--ctx", "128",
                              "--parallel", "1", "--gpu-layers", "all", env={"MESHNODE_GPU_PAD_ROWS": "8"}).wait_model()
        status = coord.get("/status")
        backends = [s.get("backend") for s in status["stages"]]
        pads = [s.get("gpu_pad_rows") for s in status["stages"]]
        served = server.get("/status")["stages"]
        if not llama_cpp.llama_supports_gpu_offload():
            # the stage server tells its peers its stage's threads once it is ready
            wait_for(lambda: coord.get("/status")["stages"][1].get("threads"), 10)
        threads = [(s.get("threads"), s.get("max_threads")) for s in coord.get("/status")["stages"]]
        coord_log, server_log = coord.log_tail(200_000), server.log_tail(200_000)
    # stage 0 was built from the coordinator's flag, stage 1 from the stage server's own
    assert re.search(r"--gpu-layers all, \d+ layer\(s\) offloaded", coord_log), coord_log[-2000:]
    assert re.search(r"--gpu-layers 3, \d+ layer\(s\) offloaded", server_log), server_log[-2000:]
    expected = "cuda" if llama_cpp.llama_supports_gpu_offload() else "cpu"
    assert backends == [expected, expected]
    # each stage's pad width is its own node's (what caps the windows sent to it)
    assert pads == [8, 6]
    # a CPU stage's threads: the coordinator's own from its engine, the peer's from that
    # peer's capabilities; the stage server's own status shows the one it serves
    cpu = 1 if expected == "cpu" else 0
    assert threads == [(cpu, cpu), (cpu, cpu)]
    assert [(s["index"], s["backend"], s["threads"], s["max_threads"]) for s in served] == [(1, expected, cpu, cpu)]


@cuda_only
@pytest.mark.slow
def test_a_cuda_build_offloads_and_reports_its_backend(synthetic_gguf):
    path = synthetic_gguf(n_layer=4)
    with StageEngine(EngineConfig(path, gpu_layers=offload.GPU_LAYERS_AUTO, n_ctx=64, n_seq_max=1)) as eng:
        assert eng.backend != "cpu" and eng.gpu_layers == 5
        # everything offloaded: one CPU thread, so its steps may run inline on the loop
        assert eng.threads_for(1) == eng.threads_for(2) == 1
    backend, free = offload.backend_summary()
    assert backend != "cpu" and free > 0


@pytest.mark.parametrize("text", ["auto", "all", "0", "7"])
def test_benchmarks_pass_the_gpu_layers_on_as_the_nodes_parse_them(text):
    from meshnode.argtypes import gpu_layers, gpu_layers_flag

    assert gpu_layers(gpu_layers_flag(gpu_layers(text))) == gpu_layers(text)
