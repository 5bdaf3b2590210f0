"""llama.cpp loads every synthetic architecture and every slice role (skipped without llama_cpp)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnode.models.slicer import write_slice

llama_cpp = pytest.importorskip("llama_cpp")


def _load(path: Path) -> int:
    m = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False)
    try:
        return m.n_vocab()
    finally:
        m.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_synthetic_and_slices_load(synthetic_gguf, tmp_path: Path, arch):
    src = synthetic_gguf(architecture=arch, n_layer=6, tied_embeddings=arch == "gemma3")
    assert _load(src) == 320
    assert _load(write_slice(src, 0, 2, tmp_path / "a.gguf", keep_embedding=True, keep_head=False)) == 320
    assert _load(write_slice(src, 2, 4, tmp_path / "b.gguf", keep_embedding=False, keep_head=False)) == 8
    assert _load(write_slice(src, 4, 6, tmp_path / "c.gguf", keep_embedding=False, keep_head=True)) == 320
