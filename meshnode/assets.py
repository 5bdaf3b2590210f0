"""Where meshnode's data files are: icons, the example config.toml and model-package.json.

They live in ``assets/`` of the source tree, which the wheel installs as the package
``meshnode_assets`` (``setup.py``). :func:`assets_dir` finds that package through
:mod:`importlib.resources`, so it works from a wheel, a zip or the PyInstaller app; a
checkout run with ``PYTHONPATH`` (no install) falls back to the ``assets/`` folder beside
``meshnode/``.
"""

from __future__ import annotations

import importlib.resources
from importlib.resources.abc import Traversable
from pathlib import Path

from meshnode.errors import MeshnodeError

__all__ = ["ASSETS_PACKAGE", "EXAMPLE_CONFIG", "EXAMPLE_MODEL_PACKAGE", "ICON_SIZES", "asset", "assets_dir"]

ASSETS_PACKAGE = "meshnode_assets"
EXAMPLE_CONFIG = "examples/config.toml"
EXAMPLE_MODEL_PACKAGE = "examples/model-package.json"
ICON_SIZES = (16, 32, 48, 64, 128, 256, 512)     # icons/meshnode-<size>.png beside icons/meshnode.svg


def assets_dir() -> Traversable:
    """The folder of data files. Raises :class:`MeshnodeError` when neither the installed
    package nor a checkout's ``assets/`` is there (a broken install)."""
    try:
        return importlib.resources.files(ASSETS_PACKAGE)
    except ModuleNotFoundError:
        pass
    checkout = Path(__file__).resolve().parent.parent / "assets"
    if (checkout / "__init__.py").is_file():
        return checkout
    raise MeshnodeError(f"meshnode's data files are missing (no {ASSETS_PACKAGE} package, "
                        f"no {checkout}): reinstall meshnode")


def asset(name: str) -> Traversable:
    """One data file, e.g. ``asset(EXAMPLE_CONFIG)`` or ``asset("icons/meshnode.svg")``."""
    return assets_dir().joinpath(*name.split("/"))
