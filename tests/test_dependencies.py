"""Every third-party module that meshnode/ or ui/ imports is a runtime dependency.

`pip install -e .` (the README's first command) installs only ``[project]
dependencies``; a module that only the ``[test]`` extra brings in passes the test suite
and still breaks the product (httpx once did: `meshnode` fell back to headless).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imported_top_level(package: Path) -> set[str]:
    names: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def _normalise(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def test_third_party_imports_are_runtime_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_normalise(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in project["dependencies"]}
    ours = {"meshnode", "ui", "tests"}
    dists = packages_distributions()
    missing = {}
    for module in sorted(_imported_top_level(ROOT / "meshnode") | _imported_top_level(ROOT / "ui")):
        if module in ours or module in sys.stdlib_module_names:
            continue
        providers = {_normalise(d) for d in dists.get(module, [])}
        assert providers, f"{module} is imported but no installed distribution provides it"
        if not providers & declared:
            missing[module] = sorted(providers)
    assert not missing, f"imported by meshnode/ or ui/ but not in [project] dependencies: {missing}"
