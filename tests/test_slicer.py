"""Slicing GGUFs by layer range: real SmolLM2, synthetic qwen2/qwen3/gemma3, bad inputs."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType

from meshnode.models.errors import ModelFileError, SliceRangeError, UnsupportedArchitectureError
from meshnode.models.gguf_info import open_gguf
from meshnode.models.slicer import (
    SUPPORTED_ARCHITECTURES,
    SliceCache,
    StageRole,
    stage_role,
    write_slice,
)

ROLE_FLAGS = {
    "first": dict(keep_embedding=True, keep_head=False),
    "middle": dict(keep_embedding=False, keep_head=False),
    "final": dict(keep_embedding=False, keep_head=True),
}


def _kv(r: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _tensors(r: gguf.GGUFReader) -> dict:
    return {t.name: t for t in r.tensors}


def _no_leftovers(folder: Path) -> None:
    assert not [p for p in folder.iterdir() if p.name.endswith(".part")]


@pytest.fixture(scope="module")
def smol_slices(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("smol_slices")
    paths = {}
    for role, (a, b) in {"first": (0, 10), "middle": (10, 20), "final": (20, 30)}.items():
        paths[role] = write_slice(smollm2.path, a, b, out / f"{role}.gguf", **ROLE_FLAGS[role])
    return paths


@pytest.mark.slow
def test_smollm2_slices_renumber_and_copy_raw(smollm2, smol_slices):
    src = open_gguf(smollm2.path)
    st = _tensors(src)
    for role, start in (("first", 0), ("middle", 10), ("final", 20)):
        r = open_gguf(smol_slices[role])
        kv = _kv(r)
        assert kv["llama.block_count"] == 10
        t = _tensors(r)
        blocks = {n for n in t if n.startswith("blk.")}
        assert {n.split(".")[1] for n in blocks} == {str(i) for i in range(10)}
        assert len(blocks) == 90
        for i in (0, 4, 9):
            for suffix in ("attn_q.weight", "ffn_down.weight", "attn_norm.weight"):
                new, old = t[f"blk.{i}.{suffix}"], st[f"blk.{start + i}.{suffix}"]
                assert new.tensor_type == old.tensor_type  # quantized types kept
                assert list(new.shape) == list(old.shape)
                assert np.array_equal(np.asarray(new.data), np.asarray(old.data))
        assert "output.weight" not in t  # SmolLM2 has a tied head
        assert "output_norm.weight" in t  # llama.cpp requires it in every slice
        # metadata other than block count and tokenizer is kept
        src_kv = _kv(src)
        for key, value in src_kv.items():
            if key.startswith("tokenizer.") or key in ("llama.block_count", "llama.vocab_size"):
                continue
            assert kv[key] == value, key


@pytest.mark.slow
def test_smollm2_first_and_final_keep_tokenizer(smollm2, smol_slices):
    src = open_gguf(smollm2.path)
    for role in ("first", "final"):
        r = open_gguf(smol_slices[role])
        kv = _kv(r)
        assert kv["tokenizer.ggml.model"] == "gpt2"
        assert kv["llama.vocab_size"] == 49152
        assert len(r.fields["tokenizer.ggml.tokens"].data) == 49152
        assert kv["tokenizer.chat_template"] == _kv(src)["tokenizer.chat_template"]
        emb = _tensors(r)["token_embd.weight"]
        assert emb.tensor_type == gguf.GGMLQuantizationType.Q8_0
        assert np.array_equal(np.asarray(emb.data), np.asarray(_tensors(src)["token_embd.weight"].data))


@pytest.mark.slow
def test_smollm2_middle_has_tiny_vocab(smol_slices, smollm2):
    r = open_gguf(smol_slices["middle"])
    kv = _kv(r)
    assert kv["tokenizer.ggml.model"] == "none"
    assert kv["llama.vocab_size"] == 8
    assert not [k for k in kv if k.startswith("tokenizer.") and k != "tokenizer.ggml.model"]
    emb = _tensors(r)["token_embd.weight"]
    assert emb.tensor_type == gguf.GGMLQuantizationType.F32
    assert list(emb.shape) == [576, 8]
    assert not np.asarray(emb.data).any()
    assert smol_slices["middle"].stat().st_size < smollm2.path.stat().st_size / 4


@pytest.mark.slow
def test_slice_cache(smollm2, tmp_path: Path):
    from meshnode.paths import NodePaths

    cache = SliceCache(NodePaths.resolve(tmp_path / "home"))
    assert cache.get(smollm2, 0, 30) == smollm2.path  # whole model: no copy
    p = cache.get(smollm2, 25, 30)
    assert p.is_file() and p.parent == tmp_path / "home" / "cache" / "slices"
    mtime = p.stat().st_mtime_ns
    assert cache.get(smollm2, 25, 30) == p
    assert p.stat().st_mtime_ns == mtime  # reused, not rebuilt
    (m,) = cache.list()
    assert (m["start"], m["end"], m["role"], m["source_sha256"]) == (25, 30, "final", smollm2.sha256)
    # a damaged slice (size changed) is rebuilt
    with open(p, "ab") as f:
        f.write(b"x")
    p2 = cache.get(smollm2, 25, 30)
    assert p2 == p and open_gguf(p2).fields["llama.block_count"].contents() == 5
    with pytest.raises(SliceRangeError):
        cache.get(smollm2, 20, 31)


def test_stage_roles():
    assert stage_role(0, 30, 30) is StageRole.WHOLE
    assert stage_role(0, 5, 30) is StageRole.FIRST
    assert stage_role(5, 10, 30) is StageRole.MIDDLE
    assert stage_role(10, 30, 30) is StageRole.FINAL
    assert StageRole.FIRST.keep_embedding and not StageRole.FIRST.keep_head
    assert StageRole.FINAL.keep_head and not StageRole.MIDDLE.keep_embedding


def test_per_layer_arrays_are_sliced(synthetic_gguf, tmp_path: Path):
    n = 8
    src = synthetic_gguf(
        n_layer=n, per_layer_head_count_kv=True,
        extra_metadata=(
            ("llama.test_per_layer", list(range(100, 100 + n)), GGUFValueType.ARRAY, GGUFValueType.INT32),
            ("general.tags", [f"t{i}" for i in range(n)], GGUFValueType.ARRAY, GGUFValueType.STRING),
        ),
    )
    out = write_slice(src, 2, 5, tmp_path / "s.gguf", **ROLE_FLAGS["middle"])
    kv = _kv(open_gguf(out))
    assert kv["llama.test_per_layer"] == [102, 103, 104]
    assert kv["llama.attention.head_count_kv"] == [2, 2, 2]
    assert kv["general.tags"] == [f"t{i}" for i in range(n)]  # not an {arch}.* key: untouched


@pytest.mark.parametrize("pattern", [None, 4, "array"])
def test_gemma3_swa_pattern_from_global_indices(synthetic_gguf, tmp_path: Path, pattern):
    n = 14
    if pattern == "array":
        written = [i % 3 != 0 for i in range(n)]
        src = synthetic_gguf(architecture="gemma3", n_layer=n, swa_pattern=written)
        expected = written
    else:
        src = synthetic_gguf(architecture="gemma3", n_layer=n, swa_pattern=pattern)
        period = 6 if pattern is None else pattern  # llama.cpp gemma3 default period: 6
        expected = [(il % period) < period - 1 for il in range(n)]
    for (a, b), flags in (((0, 5), "first"), ((3, 9), "middle"), ((9, 14), "final")):
        out = write_slice(src, a, b, tmp_path / f"g{a}.gguf", **ROLE_FLAGS[flags])
        r = open_gguf(out)
        field = r.fields["gemma3.attention.sliding_window_pattern"]
        assert field.types == [GGUFValueType.ARRAY, GGUFValueType.BOOL]
        assert field.contents() == expected[a:b]
        assert r.fields["gemma3.attention.sliding_window"].contents() == 16
        t = _tensors(r)
        for i in range(b - a):
            assert f"blk.{i}.post_attention_norm.weight" in t
            assert f"blk.{i}.post_ffw_norm.weight" in t
            assert f"blk.{i}.attn_q_norm.weight" in t
    # default rule spelled out: layers 5 and 11 are the global-attention ones
    if pattern is None:
        assert [il for il in range(n) if not expected[il]] == [5, 11]


def test_qwen2_biases_and_qwen3_norms(synthetic_gguf, tmp_path: Path):
    q2 = write_slice(synthetic_gguf("q2.gguf", architecture="qwen2", n_layer=4), 1, 3,
                     tmp_path / "q2s.gguf", **ROLE_FLAGS["middle"])
    t = _tensors(open_gguf(q2))
    assert {"blk.0.attn_q.bias", "blk.1.attn_k.bias", "blk.1.attn_v.bias"} <= set(t)
    assert "blk.2.attn_q.bias" not in t
    q3 = write_slice(synthetic_gguf("q3.gguf", architecture="qwen3", n_layer=4), 2, 4,
                     tmp_path / "q3s.gguf", **ROLE_FLAGS["final"])
    t = _tensors(open_gguf(q3))
    assert {"blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight", "output.weight"} <= set(t)


def test_untied_first_stage_drops_head_final_keeps_it(synthetic_gguf, tmp_path: Path):
    src = synthetic_gguf(n_layer=4, dtype="f16")
    first = _tensors(open_gguf(write_slice(src, 0, 2, tmp_path / "a.gguf", **ROLE_FLAGS["first"])))
    final = _tensors(open_gguf(write_slice(src, 2, 4, tmp_path / "b.gguf", **ROLE_FLAGS["final"])))
    assert "output.weight" not in first and "token_embd.weight" in first
    assert "output.weight" in final and "token_embd.weight" in final
    assert final["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16


# ---------------------------------------------------------------- bad inputs


def test_unsupported_architecture(synthetic_gguf, tmp_path: Path):
    src = synthetic_gguf(architecture="mamba")
    dest = tmp_path / "out" / "s.gguf"
    with pytest.raises(UnsupportedArchitectureError) as ei:
        write_slice(src, 1, 2, dest, **ROLE_FLAGS["middle"])
    assert str(ei.value) == (
        "architecture 'mamba' is not supported for splitting; supported: "
        + ", ".join(SUPPORTED_ARCHITECTURES)
    )
    assert not dest.exists()


@pytest.mark.parametrize("rng", [(-1, 2), (0, 0), (3, 2), (0, 5), (4, 5), (2, 2)])
def test_out_of_range(synthetic_gguf, tmp_path: Path, rng):
    src = synthetic_gguf(n_layer=4)
    dest = tmp_path / "s.gguf"
    with pytest.raises(SliceRangeError, match=r"\[0, 4\)"):
        write_slice(src, *rng, dest, **ROLE_FLAGS["middle"])
    assert not dest.exists()
    _no_leftovers(tmp_path)


def test_non_gguf_source(tmp_path: Path):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"PK\x03\x04" + bytes(100))
    dest = tmp_path / "s.gguf"
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        write_slice(src, 0, 1, dest, **ROLE_FLAGS["first"])
    assert not dest.exists()


def test_truncated_source(synthetic_gguf, tmp_path: Path):
    src = synthetic_gguf()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size - 1000])
    dest = tmp_path / "s.gguf"
    with pytest.raises(ModelFileError, match="truncated"):
        write_slice(cut, 0, 2, dest, **ROLE_FLAGS["first"])
    assert not dest.exists()
    _no_leftovers(tmp_path)


def test_failure_midway_leaves_nothing(synthetic_gguf, tmp_path: Path):
    src = synthetic_gguf(n_layer=4)
    dest = tmp_path / "s.gguf"
    calls = []

    def boom(phase, done, total):
        calls.append(done)
        if len(calls) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_slice(src, 1, 3, dest, **ROLE_FLAGS["middle"], progress=boom)
    assert not dest.exists()
    _no_leftovers(tmp_path)
    # an existing destination survives a failed rewrite untouched
    dest.write_bytes(b"old")
    with pytest.raises(SliceRangeError):
        write_slice(src, 3, 9, dest, **ROLE_FLAGS["middle"])
    assert dest.read_bytes() == b"old"


def test_progress_reports_bytes(synthetic_gguf, tmp_path: Path):
    src = synthetic_gguf(n_layer=4)
    seen = []
    write_slice(src, 0, 2, tmp_path / "s.gguf", **ROLE_FLAGS["first"],
                progress=lambda ph, d, t: seen.append((ph, d, t)))
    assert seen[0] == ("slice", 0, seen[-1][2])
    assert seen[-1][1] == seen[-1][2] > 0
    assert all(a[1] <= b[1] for a, b in zip(seen, seen[1:]))


@pytest.mark.slow
def test_gemma3_270m_real_slice(gemma3_270m, tmp_path: Path):
    out = write_slice(gemma3_270m, 3, 9, tmp_path / "g.gguf", **ROLE_FLAGS["middle"])
    r = open_gguf(out)
    assert r.fields["gemma3.block_count"].contents() == 6
    assert r.fields["gemma3.attention.sliding_window_pattern"].contents() == [
        (il + 1) % 6 != 0 for il in range(3, 9)
    ]
    src_t = _tensors(open_gguf(gemma3_270m))
    t = _tensors(r)
    for name in ("attn_output.weight", "ffn_down.weight", "post_ffw_norm.weight"):
        assert t[f"blk.0.{name}"].tensor_type == src_t[f"blk.3.{name}"].tensor_type
        assert np.array_equal(np.asarray(t[f"blk.5.{name}"].data), np.asarray(src_t[f"blk.8.{name}"].data))
