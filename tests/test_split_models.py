"""Models split into several GGUF files (llama-gguf-split's parts): read, sliced, listed,
hashed and removed as one model; their parts checked. Random-weight models (nothing is
loaded into llama.cpp here; tests/test_share.py serves a split SmolLM2 end to end)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from meshnode.models.errors import ModelFileError
from meshnode.gguf_files import model_files
from meshnode.models.gguf_info import open_gguf, read_model_info
from meshnode.models.index import list_models
from meshnode.models.slicer import write_slice
from meshnode.paths import NodePaths
from tests.gguf_split import split_gguf


@pytest.fixture
def model(synthetic_gguf) -> Path:
    return synthetic_gguf("m.gguf", n_layer=4)


def _sha(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def test_a_split_model_reads_as_the_whole_one(model, tmp_path):
    first = split_gguf(model, tmp_path / "parts", 3)
    files = model_files(first)
    assert [f.name for f in files] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert all(f.exists() for f in files)
    whole, split = read_model_info(model), read_model_info(first)
    for field in ("architecture", "n_layers", "n_embd", "n_vocab", "file_type", "chat_template", "blocks",
                  "other_tensors"):
        assert getattr(split, field) == getattr(whole, field), field
    assert split.size == sum(f.stat().st_size for f in files) > files[0].stat().st_size
    # the split.* keys are the parts' business, not the model's (a slice must not carry them)
    assert not [k for k in open_gguf(first).fields if k.startswith("split.")]


@pytest.mark.parametrize("start,end", [(0, 1), (0, 2), (1, 3), (2, 4), (3, 4), (0, 4)])
def test_slices_of_a_split_model_are_the_whole_model_s_bytes(model, tmp_path, start, end):
    first = split_gguf(model, tmp_path / "parts", 3)
    kw = dict(keep_embedding=start == 0, keep_head=end == 4)
    a = write_slice(model, start, end, tmp_path / "a.gguf", **kw)
    b = write_slice(first, start, end, tmp_path / "b.gguf", **kw)
    assert a.read_bytes() == b.read_bytes()


def test_a_split_model_s_parts_are_checked(model, tmp_path):
    first = split_gguf(model, tmp_path / "parts", 3)
    second, third = model_files(first)[1:]
    with pytest.raises(ModelFileError, match=r"part 2 of 3 of a split model: give its first part, m-00001-of-00003.gguf"):
        read_model_info(second)
    # a part renamed: llama.cpp would not find it, so neither does meshnode
    other = tmp_path / "other.gguf"
    shutil.copy(second, other)
    with pytest.raises(ModelFileError, match="not named as one"):
        read_model_info(other)
    third.rename(tmp_path / "away.gguf")
    with pytest.raises(ModelFileError, match=r"part 3 is missing: .*m-00003-of-00003.gguf"):
        read_model_info(first)
    # another file in its place (part 2 where part 3 belongs)
    shutil.copy(second, third)
    with pytest.raises(ModelFileError, match="is not part 3 of 3"):
        read_model_info(first)


def test_the_store_lists_a_split_model_once_under_the_hash_of_its_bytes(model, tmp_path, meshnode_main):
    home = tmp_path / "home"
    paths = NodePaths.resolve(home)
    first = split_gguf(model, paths.models / "big", 3)
    split_gguf(model, paths.models, 2)                       # parts dropped into the store itself
    refs = {r.name: r for r in list_models(paths)}
    assert set(refs) == {"big", "m"}, refs
    assert refs["big"].path == first and refs["big"].n_layers == 4
    assert refs["big"].sha256 == _sha(*model_files(first))  # the concatenation's: one id however cut
    assert refs["m"].sha256 == _sha(*model_files(refs["m"].path)) != refs["big"].sha256
    listed = {m["name"]: m for m in json.loads(meshnode_main("--home", str(home), "models", "list", "--json").stdout)}
    assert listed["big"]["files"] == [str(f) for f in model_files(first)]
    assert listed["big"]["size"] == sum(f.stat().st_size for f in model_files(first))
    info = meshnode_main("--home", str(home), "models", "info", "big")
    assert info.returncode == 0 and "in 3 files (a split model)" in info.stdout, info
    assert meshnode_main("--home", str(home), "models", "rm", "big").returncode == 0
    assert not (paths.models / "big").exists()               # every part, and its folder
    assert [r.name for r in list_models(paths)] == ["m"]
