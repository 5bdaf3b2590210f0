"""`meshnode models ...` end to end through meshnode.cli.main."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshnode.cli import main
from meshnode.cli.models import parse_range
from meshnode.models.gguf_info import open_gguf


@pytest.mark.slow
def test_list_info_slice(smollm2, model_store_paths, test_model_cache, tmp_path: Path, capsys):
    home = str(test_model_cache / "home")
    assert main(["models", "list", "--home", home, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert smollm2.name in [m["name"] for m in listed]

    assert main(["models", "info", smollm2.name, "--home", home, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["architecture"], info["n_layers"], info["file_type"]) == ("llama", 30, "MOSTLY_Q4_1")

    out = tmp_path / "mid.gguf"
    assert main(["models", "slice", smollm2.name, "--range", "10:15", "-o", str(out), "--home", home]) == 0
    assert "middle stage" in capsys.readouterr().out
    assert open_gguf(out).fields["llama.block_count"].contents() == 5


def test_user_errors_are_one_line(tmp_path: Path, synthetic_gguf, capsys):
    home = str(tmp_path / "home")
    src = synthetic_gguf(n_layer=4)
    out = tmp_path / "s.gguf"
    assert main(["models", "slice", str(src), "--range", "2:9", "-o", str(out), "--home", home]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshnode: error: layer range [2, 9)") and "Traceback" not in err
    assert not out.exists()
    assert main(["models", "slice", str(src), "--range", "2-3", "-o", str(out), "--home", home]) == 2
    assert "A:B" in capsys.readouterr().err
    assert main(["models", "info", "no-such-model", "--home", home]) == 2
    assert "no model 'no-such-model'" in capsys.readouterr().err
    mamba = synthetic_gguf("m.gguf", architecture="mamba")
    assert main(["models", "slice", str(mamba), "--range", "1:2", "-o", str(out), "--home", home]) == 2
    assert "architecture 'mamba' is not supported for splitting" in capsys.readouterr().err


def test_parse_range():
    assert parse_range("0:10") == (0, 10)
