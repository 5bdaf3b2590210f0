"""`meshnode models share|unshare|rm` on a store (no node running) and what it advertises."""

from __future__ import annotations

from meshnode.bench.cluster import link_model
from meshnode.cli import main
from meshnode.mesh.runtime import held_models
from meshnode.paths import NodePaths


def test_unshare_share_rm(tmp_path, synthetic_gguf, capsys):
    home = tmp_path / "home"
    link_model(home, synthetic_gguf("tiny.gguf"))
    paths = NodePaths.resolve(home)
    assert [m.shared for m in held_models(paths, shared=True)] == [True]
    assert [m.shared for m in held_models(paths, shared=False)] == [False]   # sharing off: nothing
    assert main(["models", "unshare", "tiny", "--home", str(home)]) == 0
    assert [m.shared for m in held_models(paths, shared=True)] == [False]
    assert main(["models", "share", "tiny", "--home", str(home)]) == 0
    assert [m.shared for m in held_models(paths, shared=True)] == [True]
    assert main(["models", "rm", "tiny", "--home", str(home)]) == 0
    assert held_models(paths) == [] and not list(paths.models.rglob("*.gguf*"))
    assert main(["models", "rm", "tiny", "--home", str(home)]) != 0
    assert "no model 'tiny'" in capsys.readouterr().err


def test_a_stopped_pull_is_listed_apart_and_rm_gives_its_space_back(tmp_path, capsys):
    home = tmp_path / "home"
    paths = NodePaths.resolve(home).ensure()
    part = paths.models / "big.gguf.part"           # what a killed `models pull big` leaves
    part.write_bytes(b"\1" * 300_000)
    (paths.models / "big.gguf.part.json").write_text('{"sha256": "ab", "chunks": [0]}')
    assert main(["models", "list", "--home", str(home)]) == 0
    out = capsys.readouterr().out
    assert "big" in out and "a pull stopped with" in out and "models rm big" in out
    assert main(["models", "list", "--json", "--home", str(home)]) == 0
    assert capsys.readouterr().out.strip() == "[]"                      # never a model
    assert main(["models", "rm", "big", "--home", str(home)]) == 0
    assert "removed the partial pull of big" in capsys.readouterr().out
    assert list(paths.models.iterdir()) == []
