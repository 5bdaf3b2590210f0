"""Fetching a GGUF by URL (meshnode/models/url_fetch.py) over real HTTP from a local
server: into the store, a split model's every part, a stopped download resumed with a
Range request, a server that ignores Range, bad sizes, sha256s, names and files."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from meshnode.models.errors import ChecksumError, ModelFetchError, ModelFileError
from meshnode.gguf_files import model_files
from meshnode.models.index import list_models
from meshnode.models.store import resolve_model
from meshnode.models.url_fetch import DOWNLOAD_SUFFIX, fetch_url, is_model_url, model_url
from meshnode.paths import NodePaths
from tests.gguf_split import split_gguf


class Files:
    """What the server serves and how it misbehaves (per test)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cut_after: int | None = None   # close the connection after this many bytes (once)
        self.cut_file: str | None = None    # ... of this file only (None: the next one asked for)
        self.ranges = True                  # honour Range requests
        self.requests: list[tuple[str, str | None]] = []
        self.auth: list[str | None] = []    # the Authorization header of each request
        self.redirect: str | None = None    # answer 302 to this base URL + the file name
        self.refuse: int | None = None      # answer every request with this error status
        self.listing: bytes | None = None   # the body of /api/... (a Hugging Face listing)


def _handler(files: Files) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            name = self.path.rsplit("/", 1)[-1]
            rng = self.headers.get("Range")
            files.requests.append((name, rng))
            files.auth.append(self.headers.get("Authorization"))
            if files.refuse is not None:
                self.send_error(files.refuse)
                return
            if self.path.startswith("/api/") and files.listing is not None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(files.listing)))
                self.end_headers()
                self.wfile.write(files.listing)
                return
            if files.redirect is not None:
                self.send_response(302)
                self.send_header("Location", files.redirect + name)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            path = files.root / name
            if not path.is_file():
                self.send_error(404)
                return
            data = path.read_bytes()
            start = int(rng.split("=")[1].rstrip("-")) if rng and files.ranges else 0
            body = data[start:]
            self.send_response(206 if start else 200)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if files.cut_after is not None and files.cut_file in (None, name):
                self.wfile.write(body[:files.cut_after])
                files.cut_after = None
                self.wfile.flush()
                self.connection.shutdown(2)
                return
            self.wfile.write(body)

    return Handler


@contextlib.contextmanager
def _serving(root: Path, host: str = "127.0.0.1") -> Iterator[tuple[str, Files]]:
    files = Files(root)
    files.root.mkdir(exist_ok=True)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(files))
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://{host}:{httpd.server_address[1]}/models/", files
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def server(tmp_path) -> Iterator[tuple[str, Files]]:
    with _serving(tmp_path / "served") as served:
        yield served


@pytest.fixture
def paths(tmp_path) -> NodePaths:
    return NodePaths.resolve(tmp_path / "home").ensure()


def _sha(*files: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


def test_hf_names_map_to_hugging_face_download_urls():
    assert model_url("hf:bartowski/Llama-3.2-1B-Instruct-GGUF/Llama-3.2-1B-Instruct-Q4_K_M.gguf") == \
        "https://huggingface.co/bartowski/Llama-3.2-1B-Instruct-GGUF/resolve/main/Llama-3.2-1B-Instruct-Q4_K_M.gguf"
    assert model_url("hf:o/r@v1.0/sub/m.gguf") == "https://huggingface.co/o/r/resolve/v1.0/sub/m.gguf"
    assert model_url("smollm2") is None and model_url("/home/me/m.gguf") is None
    # the address of a file's web page is its download's
    assert model_url("https://huggingface.co/o/r/blob/main/m.gguf") == "https://huggingface.co/o/r/resolve/main/m.gguf"
    assert model_url("https://example.com/o/r/blob/main/m.gguf") == "https://example.com/o/r/blob/main/m.gguf"
    assert model_url("hf:o/r:Q4_K_M") is None and is_model_url("hf:o/r:Q4_K_M") and is_model_url("hf:o/r")
    for bad in ("hf:o/r/m.bin", "hf:o", "hf:o/r/../../x.gguf", "https://example.com/m.bin", "https://example.com/models/"):
        with pytest.raises(ModelFetchError):
            is_model_url(bad)


def test_a_url_is_fetched_into_the_store_once(server, paths, synthetic_gguf):
    base, files = server
    src = synthetic_gguf("tiny-q8.gguf", n_layer=2)
    (files.root / src.name).write_bytes(src.read_bytes())
    progress: list[tuple[str, int, int | None]] = []
    ref = fetch_url(base + src.name, paths, progress=lambda *a: progress.append(a))
    assert ref.name == "tiny-q8" and ref.path == paths.models / "tiny-q8" / "tiny-q8.gguf"
    assert ref.sha256 == _sha(src) and ref.path.read_bytes() == src.read_bytes()
    assert progress[-1] == ("download", src.stat().st_size, src.stat().st_size)
    assert [r.name for r in list_models(paths)] == ["tiny-q8"]
    again = fetch_url(base + src.name, paths)           # in the store: no second download
    assert again.sha256 == ref.sha256 and len(files.requests) == 1
    # `serve --model URL` resolves the same way (only where URLs are allowed)
    assert resolve_model(base + src.name, paths, allow_url=True).sha256 == ref.sha256
    with pytest.raises(ModelFileError):
        resolve_model(base + src.name, paths)


def test_a_stopped_download_resumes_with_a_range_request(server, paths, synthetic_gguf):
    base, files = server
    src = synthetic_gguf("m.gguf", n_layer=3)
    (files.root / src.name).write_bytes(src.read_bytes())
    files.cut_after = 100_000
    with pytest.raises(ModelFetchError, match="stopped at 100000 of .* the same command resumes it"):
        fetch_url(base + src.name, paths)
    part = paths.models / "m" / ("m.gguf" + DOWNLOAD_SUFFIX)
    assert part.stat().st_size == 100_000 and not (paths.models / "m" / "m.gguf").exists()
    assert list_models(paths) == []                      # not a model until whole
    ref = fetch_url(base + src.name, paths)
    assert files.requests[-1] == ("m.gguf", "bytes=100000-")
    assert ref.sha256 == _sha(src) and ref.path.read_bytes() == src.read_bytes() and not part.exists()


def test_a_stopped_fetch_is_listed_apart_and_removed_by_rm(server, tmp_path, synthetic_gguf, meshnode_main):
    base, files = server
    src = synthetic_gguf("big.gguf", n_layer=4)
    first = split_gguf(src, files.root, 3)
    home = tmp_path / "cli"
    files.cut_after, files.cut_file = 20_000, first.name.replace("00001-of", "00002-of")
    r = meshnode_main("--home", str(home), "models", "fetch", base + first.name)
    assert r.returncode != 0 and "the same command resumes it" in r.stderr, r
    # part 1 is whole, 2 and 3 are not there: the folder is no model yet (listing works)
    assert (home / "data" / "models" / "big" / first.name).exists()
    listed = meshnode_main("--home", str(home), "models", "list")
    assert listed.returncode == 0 and "big" in listed.stdout and "a download stopped" in listed.stdout, listed
    assert f"`meshnode models fetch {base + first.name}` resumes it" in listed.stdout
    gone = meshnode_main("--home", str(home), "models", "rm", "big")
    assert gone.returncode == 0 and not (home / "data" / "models" / "big").exists(), gone


def test_a_name_taken_by_another_model_is_refused(server, paths, synthetic_gguf):
    base, files = server
    a, b = synthetic_gguf("a.gguf", n_layer=2), synthetic_gguf("b.gguf", n_layer=3)
    for src in (a, b):
        (files.root / src.name).write_bytes(src.read_bytes())
    fetch_url(base + "a.gguf", paths, name="mine")
    with pytest.raises(ModelFetchError, match="mine is already in the store"):
        fetch_url(base + "b.gguf", paths, name="mine")


def test_a_server_that_ignores_range_starts_the_file_over(server, paths, synthetic_gguf):
    base, files = server
    src = synthetic_gguf("m.gguf", n_layer=3)
    (files.root / src.name).write_bytes(src.read_bytes())
    files.cut_after, files.ranges = 50_000, False
    with pytest.raises(ModelFetchError):
        fetch_url(base + src.name, paths)
    ref = fetch_url(base + src.name, paths)
    assert ref.sha256 == _sha(src) and ref.path.read_bytes() == src.read_bytes()


def test_a_split_model_brings_every_part(server, paths, synthetic_gguf):
    base, files = server
    src = synthetic_gguf("big.gguf", n_layer=4)
    first = split_gguf(src, files.root, 3)
    files.cut_after = 20_000                              # stop inside the first part once
    with pytest.raises(ModelFetchError):
        fetch_url(base + first.name, paths)
    ref = fetch_url(base + first.name, paths)
    got = model_files(ref.path)
    assert [f.name for f in got] == [f.name for f in model_files(first)] and ref.name == "big"
    assert ref.sha256 == _sha(*model_files(first)) and ref.n_layers == 4
    assert [r for _, r in files.requests] == [None, "bytes=20000-", None, None]


def test_a_wrong_sha256_or_a_file_that_is_no_gguf_leaves_nothing(server, paths, synthetic_gguf):
    base, files = server
    src = synthetic_gguf("m.gguf", n_layer=2)
    (files.root / src.name).write_bytes(src.read_bytes())
    with pytest.raises(ChecksumError, match="expected 0000"):
        fetch_url(base + src.name, paths, sha256="0" * 64)
    assert not (paths.models / "m").exists()
    (files.root / "junk.gguf").write_bytes(b"not a model" * 100)
    with pytest.raises(ModelFileError, match="not a GGUF"):
        fetch_url(base + "junk.gguf", paths)
    assert not (paths.models / "junk").exists()
    assert list_models(paths) == []
    with pytest.raises(ModelFetchError, match="--name"):
        fetch_url(base + src.name, paths, name="../escape")
    with pytest.raises(ModelFetchError, match="HTTP 404"):
        fetch_url(base + "missing.gguf", paths)


def test_the_cli_fetches_a_url_with_a_name_and_a_checked_sha256(server, tmp_path, synthetic_gguf, meshnode_main):
    base, files = server
    src = synthetic_gguf("m.gguf", n_layer=2)
    (files.root / src.name).write_bytes(src.read_bytes())
    home = str(tmp_path / "cli")
    r = meshnode_main("--home", home, "models", "fetch", base + src.name, "--name", "mine", "--sha256", _sha(src))
    assert r.returncode == 0 and "mine: " in r.stdout and "verified" in r.stdout, r
    bad = meshnode_main("--home", home, "models", "fetch", base + src.name, "--sha256", "12")
    assert bad.returncode == 2 and "64 hex digits" in bad.stderr
    named = meshnode_main("--home", home, "models", "fetch", "smollm2-135m-instruct-q4_1", "--name", "x")
    assert named.returncode == 2 and "go with a URL" in named.stderr


def test_the_token_goes_to_the_model_host_only_and_a_refusal_says_what_to_do(tmp_path, paths, synthetic_gguf,
                                                                            monkeypatch):
    # the host of the URL gets HF_TOKEN; the one it redirects to (a CDN) does not, and a
    # resumed download's Range follows the redirect
    import meshnode.models.url_fetch as url_fetch

    src = synthetic_gguf("m.gguf", n_layer=2)
    with _serving(tmp_path / "cdn", host="localhost") as (cdn_base, cdn), _serving(tmp_path / "hub") as (hub_base, hub):
        (cdn.root / src.name).write_bytes(src.read_bytes())
        hub.redirect = cdn_base
        monkeypatch.setattr(url_fetch, "TOKEN_HOSTS", frozenset({"127.0.0.1"}))
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        cdn.cut_after = 30_000
        with pytest.raises(ModelFetchError):
            fetch_url(hub_base + src.name, paths)
        ref = fetch_url(hub_base + src.name, paths)
        assert ref.sha256 == _sha(src)
        assert hub.auth == ["Bearer hf_secret"] * 2 and cdn.auth == [None, None]
        assert cdn.requests == [("m.gguf", None), ("m.gguf", "bytes=30000-")]
        hub.redirect, hub.refuse = None, 401    # a gated model without the token
        with pytest.raises(ModelFetchError, match="HTTP 401.*accept its terms on its page and set HF_TOKEN"):
            fetch_url(hub_base + "gated.gguf", paths)


def test_a_fetch_that_got_no_byte_leaves_nothing(paths):
    with pytest.raises(ModelFetchError, match=r"cannot download http://127.0.0.1:1/m.gguf: .*refused"):
        fetch_url("http://127.0.0.1:1/m.gguf", paths)
    assert not (paths.models / "m").exists() and list_models(paths) == []


def test_a_second_fetch_of_the_same_model_at_once_is_refused(server, paths, synthetic_gguf):
    import fcntl

    base, files = server
    src = synthetic_gguf("m.gguf", n_layer=2)
    (files.root / src.name).write_bytes(src.read_bytes())
    folder = paths.models / "m"
    folder.mkdir(parents=True)
    with open(folder / ".fetch-url", "a+") as held:          # another process fetching it
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(ModelFetchError, match="another fetch of m is running"):
            fetch_url(base + src.name, paths)
    assert fetch_url(base + src.name, paths).sha256 == _sha(src)


def _listing(*files: Path, sha: dict[str, str] | None = None) -> bytes:
    import json

    sha = sha or {}
    return json.dumps([{"type": "directory", "path": "docs"}, {"type": "file", "path": "README.md", "size": 10}] + [
        {"type": "file", "path": f.name, "size": f.stat().st_size,
         "lfs": {"oid": sha.get(f.name, _sha(f)), "size": f.stat().st_size}} for f in files]).encode()


def test_a_hugging_face_repository_gives_the_model_of_a_quantization(tmp_path, paths, synthetic_gguf, monkeypatch,
                                                                     caplog):
    # a fake HF_ENDPOINT: the listing API and /resolve/ downloads, as huggingface.co has them
    with _serving(tmp_path / "hub") as (base, hub):
        monkeypatch.setenv("HF_ENDPOINT", base.removesuffix("/models/"))
        q4 = synthetic_gguf("Tiny-Q4_K_M.gguf", n_layer=2)
        q8 = synthetic_gguf("Tiny-Q8_0.gguf", n_layer=3)
        big = split_gguf(synthetic_gguf("Big-Q4_0.gguf", n_layer=4), hub.root, 2)
        for f in (q4, q8):
            (hub.root / f.name).write_bytes(f.read_bytes())
        hub.listing = _listing(hub.root / q4.name, hub.root / q8.name, *model_files(big))
        with caplog.at_level(logging.INFO, logger="meshnode.models.url_fetch"):
            ref = fetch_url("hf:me/tiny-GGUF:q8_0", paths)      # any case
        assert ref.name == "Tiny-Q8_0" and ref.sha256 == _sha(q8) and ref.n_layers == 3
        assert "hf:me/tiny-GGUF:q8_0 is Tiny-Q8_0.gguf (1 file, " in caplog.text
        ref = fetch_url("hf:me/tiny-GGUF", paths)               # the default, Q4_K_M
        assert ref.name == "Tiny-Q4_K_M" and ref.sha256 == _sha(q4)
        ref = fetch_url("hf:me/tiny-GGUF:Q4_0", paths)          # a split model: every part
        assert ref.name == "Big-Q4_0" and ref.sha256 == _sha(*model_files(big))
        asked = len(hub.requests)
        # fetched before: found in the store by the name typed, without asking the hub
        assert fetch_url("hf:me/tiny-GGUF:q8_0", paths).sha256 == _sha(q8) and len(hub.requests) == asked
        with pytest.raises(ModelFetchError, match="no model of IQ2_XS; it has: Big-Q4_0-00001-of-00002.gguf, "
                                                  "Tiny-Q4_K_M.gguf, Tiny-Q8_0.gguf"):
            fetch_url("hf:me/tiny-GGUF:IQ2_XS", paths)


def test_a_file_unlike_its_listing_is_deleted(tmp_path, paths, synthetic_gguf, monkeypatch):
    with _serving(tmp_path / "hub") as (base, hub):
        monkeypatch.setenv("HF_ENDPOINT", base.removesuffix("/models/"))
        q4 = synthetic_gguf("Tiny-Q4_K_M.gguf", n_layer=2)
        (hub.root / q4.name).write_bytes(q4.read_bytes())
        hub.listing = _listing(hub.root / q4.name, sha={q4.name: "ab" * 32})
        with pytest.raises(ChecksumError, match="its repository lists abab"):
            fetch_url("hf:me/tiny-GGUF", paths)
        assert list_models(paths) == [] and not list((paths.models / "Tiny-Q4_K_M").glob("*.gguf*"))
        hub.listing = b"<html>rate limited</html>"
        with pytest.raises(ModelFetchError, match="not what Hugging Face sends"):
            fetch_url("hf:me/tiny-GGUF", paths)
