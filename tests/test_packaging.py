"""The wheel carries meshnode, ui and the data files, and its command reports the version."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from meshnode import __version__
from meshnode.assets import EXAMPLE_CONFIG, EXAMPLE_MODEL_PACKAGE, ICON_SIZES, asset, assets_dir

ROOT = Path(__file__).resolve().parent.parent


def test_assets_are_found_from_a_checkout_or_an_install():
    assert asset("icons/meshnode.svg").read_text(encoding="utf-8").lstrip().startswith("<svg")
    for size in ICON_SIZES:
        assert asset(f"icons/meshnode-{size}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert asset(EXAMPLE_CONFIG).is_file() and asset(EXAMPLE_MODEL_PACKAGE).is_file()
    assert assets_dir().joinpath("__init__.py").is_file()


def test_the_desktop_entry_names_the_command_and_the_icon():
    entry = (ROOT / "packaging" / "linux" / "meshnode.desktop").read_text()
    assert "Exec=meshnode\n" in entry and "Icon=meshnode\n" in entry and "Terminal=true" in entry


@pytest.mark.slow
def test_the_wheel_carries_the_code_the_tui_and_the_assets(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".cache", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                        str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "dist").glob("meshnode-*.whl")
    assert wheel.name.startswith(f"meshnode-{__version__}-py3-none-any")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "meshnode/__init__.py", "meshnode/cli/service.py", "meshnode/engine/_tap.c", "meshnode/net/_spin.c",
        "meshnode/py.typed",
        "ui/app.py", "meshnode_assets/__init__.py", "meshnode_assets/icons/meshnode.svg",
        "meshnode_assets/examples/config.toml", "meshnode_assets/examples/model-package.json",
        *(f"meshnode_assets/icons/meshnode-{s}.png" for s in ICON_SIZES),
    }
    assert expected <= names, sorted(expected - names)
    assert any(n.startswith("ui/") and n.endswith(".tcss") for n in names)
    assert not any(n.startswith(("tests/", "assets/", "packaging/")) for n in names)
    meta = zipfile.ZipFile(wheel).read(f"meshnode-{__version__}.dist-info/entry_points.txt").decode()
    assert "meshnode = meshnode.cli:main" in meta

    # installed next to nothing else, the data files are found through importlib.resources
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    probe = ("import meshnode.assets as a; print(a.assets_dir()); "
             "print(a.asset(a.EXAMPLE_CONFIG).read_text()[:1])")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert str(target / "meshnode_assets") in r.stdout


@pytest.mark.slow
def test_meshnode_version_prints_the_version():
    from nodeproc import meshnode_cmd

    r = meshnode_cmd("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"meshnode {__version__}"
