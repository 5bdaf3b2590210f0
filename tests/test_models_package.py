"""model-package.json parsing: good packages, and errors that name the bad field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshnode.models.errors import ModelPackageError
from meshnode.models.package import (
    ModelPackage,
    WindowPolicy,
    find_model_package,
    load_model_package,
    parse_model_package,
)

GOOD = {
    "name": "smollm2-135m",
    "generation": {
        "speculative_decoding": {
            "default": "draft",
            "strategies": {
                "draft": {
                    "type": "draft-model",
                    "draft_model": "draft.gguf",
                    "window_policy": {"default": "adaptive", "initial_window": 4,
                                      "min_window": 2, "max_window": 12},
                },
                "lookup": {"type": "ngram", "window_policy": {"default": "fixed", "initial_window": 3,
                                                              "min_window": 3, "max_window": 3}},
            },
        }
    },
}


def test_parse_good(tmp_path: Path):
    (tmp_path / "draft.gguf").write_bytes(b"")
    path = tmp_path / "model-package.json"
    path.write_text(json.dumps(GOOD))
    pkg = load_model_package(path)
    assert isinstance(pkg, ModelPackage) and pkg.name == "smollm2-135m"
    sd = pkg.speculative_decoding
    assert sd is not None and sd.default == "draft"
    assert [s.name for s in sd.strategies] == ["draft", "lookup"]
    assert sd.strategy().window_policy == WindowPolicy("adaptive", 4, 2, 12)
    assert sd.strategy("lookup").type == "ngram" and sd.strategy("lookup").draft_model is None
    assert pkg.draft_model_spec() == str((tmp_path / "draft.gguf").resolve())
    assert pkg.draft_model_spec("lookup") is None
    with pytest.raises(AttributeError):
        pkg.name = "x"  # frozen
    assert find_model_package(tmp_path / "model.gguf") == pkg
    assert find_model_package(tmp_path / "elsewhere" / "m.gguf") is None


def test_minimal_and_defaults():
    assert parse_model_package({"name": "m"}).speculative_decoding is None
    pkg = parse_model_package({"name": "m", "generation": {"speculative_decoding": {
        "default": "d", "strategies": {"d": {"type": "draft-model", "draft_model": "small"}}}}})
    s = pkg.speculative_decoding.strategy()
    assert s.window_policy == WindowPolicy("adaptive", 4, 1, 16)
    assert pkg.draft_model_spec() == "small"  # a store name, passed through


def _with(path: str, value, base=GOOD):
    data = json.loads(json.dumps(base))
    keys = path.split(".")
    node = data
    for k in keys[:-1]:
        node = node[k]
    if value is KeyError:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return data


SD = "generation.speculative_decoding"
DRAFT = f"{SD}.strategies.draft"


@pytest.mark.parametrize("path,value,field", [
    ("name", KeyError, "name"),
    ("name", 3, "name"),
    ("colour", "red", "colour"),
    (f"{SD}.default", "nope", f"{SD}.default"),
    (f"{SD}.strategies", {}, f"{SD}.strategies"),
    (f"{DRAFT}.type", "magic", f"{DRAFT}.type"),
    (f"{DRAFT}.draft_model", KeyError, f"{DRAFT}.draft_model"),
    (f"{SD}.strategies.lookup.draft_model", "x.gguf", f"{SD}.strategies.lookup.draft_model"),
    (f"{DRAFT}.window_policy.default", "eager", f"{DRAFT}.window_policy.default"),
    (f"{DRAFT}.window_policy.max_window", 64, f"{DRAFT}.window_policy.max_window"),
    (f"{DRAFT}.window_policy.max_window", "8", f"{DRAFT}.window_policy.max_window"),
    (f"{DRAFT}.window_policy.min_window", 0, f"{DRAFT}.window_policy.min_window"),
    (f"{DRAFT}.window_policy.initial_window", 20, f"{DRAFT}.window_policy.initial_window"),
    (f"{DRAFT}.window_policy.initial_window", True, f"{DRAFT}.window_policy.initial_window"),
    (f"{DRAFT}.window_policy.maximum", 3, f"{DRAFT}.window_policy.maximum"),
])
def test_errors_name_the_field(path, value, field):
    with pytest.raises(ModelPackageError) as ei:
        parse_model_package(_with(path, value))
    assert f"{field}:" in str(ei.value)


def test_bad_json_and_missing_file(tmp_path: Path):
    p = tmp_path / "model-package.json"
    p.write_text('{"name": ')
    with pytest.raises(ModelPackageError, match="not valid JSON"):
        load_model_package(p)
    with pytest.raises(ModelPackageError, match="not found"):
        load_model_package(tmp_path / "none.json")
    p.write_text("[1, 2]")
    with pytest.raises(ModelPackageError, match="must be an object"):
        load_model_package(p)
