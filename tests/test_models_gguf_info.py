"""read_model_info on real and synthetic GGUFs, and every way a file can be bad."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnode.errors import MeshnodeError
from meshnode.models.errors import ModelFileError
from meshnode.models.gguf_info import block_index, read_model_info


@pytest.mark.slow
def test_smollm2_info(smollm2):
    info = read_model_info(smollm2.path)
    assert info.architecture == "llama"
    assert info.n_layers == 30
    assert info.n_embd == 576
    assert info.n_vocab == 49152
    assert info.file_type_name == "MOSTLY_Q4_1"
    assert info.tied_embeddings  # no output.weight
    assert info.chat_template and "im_start" in info.chat_template
    assert info.tokenizer_model == "gpt2"
    assert len(info.blocks) == 30
    assert all(len(b) == 9 for b in info.blocks)
    assert {t.name for t in info.blocks[7]} >= {"blk.7.attn_q.weight", "blk.7.ffn_down.weight"}
    assert {t.name for t in info.other_tensors} == {"token_embd.weight", "output_norm.weight"}
    assert info.size == smollm2.path.stat().st_size
    assert info.n_tensor_bytes < info.size


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_synthetic_info(synthetic_gguf, arch):
    p = synthetic_gguf(architecture=arch, n_layer=3, vocab=300)
    info = read_model_info(p)
    assert (info.architecture, info.n_layers, info.n_embd, info.n_vocab) == (arch, 3, 64, 300)
    assert not info.tied_embeddings
    assert info.file_type_name == "ALL_F32"


def test_block_index():
    assert block_index("blk.12.attn_q.weight") == 12
    assert block_index("token_embd.weight") is None
    assert block_index("blkx.1.a") is None


def test_missing_file(tmp_path: Path):
    with pytest.raises(ModelFileError, match="not found"):
        read_model_info(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path: Path):
    p = tmp_path / "notes.gguf"
    p.write_text("hello, this is certainly not a model file\n" * 10)
    with pytest.raises(ModelFileError, match="not a GGUF file") as ei:
        read_model_info(p)
    assert str(p) in str(ei.value)
    assert isinstance(ei.value, MeshnodeError)


def test_empty_file(tmp_path: Path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        read_model_info(p)


@pytest.mark.parametrize("keep", [30, 200, 5000, 0.6, 0.999])
def test_truncated(synthetic_gguf, tmp_path: Path, keep):
    src = synthetic_gguf()
    data = src.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:n])
    with pytest.raises(ModelFileError, match="truncated") as ei:
        read_model_info(p)
    assert str(p) in str(ei.value)


def test_missing_block_count(synthetic_gguf, tmp_path: Path):
    import gguf

    # a GGUF with an architecture but no {arch}.block_count
    p = tmp_path / "nokeys.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_uint32("llama.embedding_length", 8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="llama.block_count"):
        read_model_info(p)
