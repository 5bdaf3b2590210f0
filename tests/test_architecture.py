"""The package layering is enforced: pyproject.toml's import-linter contracts hold.

The contracts ([tool.importlinter] in pyproject.toml) are the dependency rules of
docs/architecture.md: which package may import which, that the node never imports the
TUI, that only the engine imports llama_cpp. A change that breaks one fails here with
import-linter's report of the offending import chain.

import-linter runs in this process (no subprocess): it only reads the source files.
It finds the packages to analyse through ``importlib``, so each run points ``sys.path``
(and the working directory) at the tree under test and hides the already imported
``meshnode`` / ``ui`` for the duration of the run.
"""

from __future__ import annotations

import ast
import logging
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

from importlinter.cli import lint_imports  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _lint(root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> tuple[bool, str]:
    """Lint the tree at ``root`` with its pyproject.toml; (passed, import-linter's report)."""
    # lint_imports puts the working directory first on sys.path (as `lint-imports` run
    # from the repository root would): run it from ``root``, on a copy of sys.path.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))
    for name in ("meshnode", "ui"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    capsys.readouterr()
    # import-linter configures logging with dictConfig, which disables every logger that
    # exists already (meshnode's among them): later tests' caplog would see nothing.
    loggers = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    disabled = {lg: lg.disabled for lg in loggers}
    try:
        status = lint_imports(config_filename=str(root / "pyproject.toml"), no_cache=True)
    finally:
        for lg, was in disabled.items():
            lg.disabled = was
    return status == 0, capsys.readouterr().out


def test_the_import_contracts_hold(monkeypatch, capsys):
    passed, report = _lint(ROOT, monkeypatch, capsys)
    assert passed, f"an import contract is broken (see docs/architecture.md):\n{report}"
    assert "0 broken" in report


def _copy_tree(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("meshnode", "ui"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_a_layer_importing_upwards_breaks_the_layers_contract(tmp_path, monkeypatch, capsys):
    tree = _copy_tree(tmp_path)
    (tree / "meshnode" / "wire" / "upwards.py").write_text("from meshnode.serve import app\n")
    passed, report = _lint(tree, monkeypatch, capsys)
    assert not passed, report
    assert "meshnode: each package imports only the layers below it BROKEN" in report
    assert "meshnode.wire.upwards -> meshnode.serve.app" in report


def test_the_node_importing_textual_breaks_its_contract(tmp_path, monkeypatch, capsys):
    tree = _copy_tree(tmp_path)
    (tree / "meshnode" / "mesh" / "pretty.py").write_text(
        "def show():\n    import textual  # lazy imports count too\n")
    passed, report = _lint(tree, monkeypatch, capsys)
    assert not passed, report
    assert "meshnode never imports the TUI (ui, Textual) BROKEN" in report
    assert "meshnode.mesh.pretty -> textual" in report


def test_a_new_top_level_module_must_be_placed_in_a_layer(tmp_path, monkeypatch, capsys):
    tree = _copy_tree(tmp_path)
    (tree / "meshnode" / "helpers.py").write_text("X = 1\n")
    passed, report = _lint(tree, monkeypatch, capsys)
    assert not passed, report
    assert "meshnode.helpers" in report and "not listed as layers" in report


def _package_of(module: str) -> str:
    """``meshnode.serve.service`` -> ``meshnode.serve``; ``ui.app`` -> ``ui``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "meshnode" else parts[0]


def test_no_private_name_is_imported_across_packages():
    """What another package needs is public: ``from meshnode.serve.service import
    _Unavailable`` in node.py hid a dependency on an implementation detail."""
    found = []
    for top in ("meshnode", "ui"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            importer = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                    continue
                if node.module.split(".")[0] not in ("meshnode", "ui"):
                    continue
                if _package_of(node.module) == _package_of(importer):
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{rel}.py:{node.lineno}: {node.module}.{alias.name}")
    assert not found, "private names imported from another package:\n" + "\n".join(found)
