"""Picking a model's files from a Hugging Face repository listing (pure logic)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.models.errors import ModelFetchError
from meshnode.models.hf_repo import RepoFile, choose, parse_hf, parse_listing


def _files(*names: str) -> list[RepoFile]:
    return [RepoFile(n, 1, None) for n in names]


def test_the_two_forms_of_a_name():
    s = parse_hf("hf:bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M")
    assert (s.owner, s.repo, s.rev, s.path, s.quant) == ("bartowski", "Qwen2.5-7B-Instruct-GGUF", "main", None, "Q4_K_M")
    s = parse_hf("hf:o/r@v2/sub/m.gguf")
    assert (s.rev, s.path, s.quant) == ("v2", "sub/m.gguf", None)
    assert parse_hf("smollm2") is None
    for bad in ("hf:", "hf:o", "hf:o/r/x.bin", "hf:o/r:Q4 K", "hf:../r", "hf:o/r/../x.gguf"):
        with pytest.raises(ModelFetchError):
            parse_hf(bad)


def test_a_quantization_picks_a_whole_word_and_every_part():
    files = _files("a/M-Q4_K_M.gguf", "a/M-Q4_K_M_L.gguf", "M-Q8_0-00001-of-00002.gguf",
                   "M-Q8_0-00002-of-00002.gguf", "mmproj-M-f16.gguf", "M-Q5_K_M-00001-of-00002.gguf")
    assert [f.path for f in choose(files, "q4_k_m")] == ["a/M-Q4_K_M.gguf"]
    assert [f.path for f in choose(files, "Q8_0")] == ["M-Q8_0-00001-of-00002.gguf", "M-Q8_0-00002-of-00002.gguf"]
    assert [f.path for f in choose(files, None)] == ["a/M-Q4_K_M.gguf"]      # the default
    with pytest.raises(ModelFetchError, match="no model of Q5_K_M"):       # a part missing: no model
        choose(files, "Q5_K_M")
    with pytest.raises(ModelFetchError, match="no model of F16"):          # never a projector
        choose(files, "F16")
    assert [f.path for f in choose(_files("only-IQ3_M.gguf", "mmproj-f16.gguf"), None)] == ["only-IQ3_M.gguf"]
    with pytest.raises(ModelFetchError, match="2 models of Q4_0"):
        choose(_files("A-Q4_0.gguf", "B-Q4_0.gguf"), "Q4_0")
    with pytest.raises(ModelFetchError, match="holds no GGUF"):
        choose([], None)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=20))
def test_a_hostile_listing_is_refused_or_read_without_error(value):
    try:
        files = parse_listing(json.dumps(value).encode())
    except ModelFetchError:
        assert not isinstance(value, list)
        return
    assert all(f.path.endswith(".gguf") and f.size >= 0 for f in files)
