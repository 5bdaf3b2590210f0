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
