"""Downloads do not trust the server (issue #17, finding 11): real HTTP on 127.0.0.1."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import namedtuple
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from meshnode import fsutil
from meshnode.models import fetch
from meshnode.models.errors import ChecksumError, ModelFetchError

EXPECTED = b"m" * 100_000


class _Server:
    """Serves ``body`` (``chunks`` times) with the Content-Length it is told to announce."""

    def __init__(self, repeat: int, announce: int | None) -> None:
        self.sent = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                self.send_response(200)
                if announce is not None:
                    self.send_header("Content-Length", str(announce))
                self.end_headers()
                try:
                    for _ in range(repeat):
                        self.wfile.write(EXPECTED)
                        server.sent += len(EXPECTED)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *a) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/model.whl"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server_factory():
    made: list[_Server] = []

    def make(repeat: int, announce: int | None) -> _Server:
        made.append(_Server(repeat, announce))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_download_stops_as_soon_as_it_passes_the_expected_size(server_factory, tmp_path: Path):
    # The server announces nothing and sends 2000x the expected bytes (200 MB).
    srv = server_factory(repeat=2000, announce=None)
    written: list[int] = []
    with pytest.raises(ChecksumError, match="more than the expected"):
        fetch.download_file(srv.url, tmp_path / "m.whl", sha256=hashlib.sha256(EXPECTED).hexdigest(),
                            size=len(EXPECTED), progress=lambda _s, done, _t: written.append(done))
    assert max(written) <= len(EXPECTED)           # never wrote past it
    assert not list(tmp_path.iterdir())             # nothing left behind


def test_download_announcing_another_size_is_refused_before_writing(server_factory, tmp_path: Path):
    srv = server_factory(repeat=3, announce=3 * len(EXPECTED))
    with pytest.raises(ChecksumError, match="announces"):
        fetch.download_file(srv.url, tmp_path / "m.whl", sha256="0" * 64, size=len(EXPECTED))
    assert not list(tmp_path.iterdir())


def test_no_download_without_free_space(server_factory, tmp_path: Path, monkeypatch):
    srv = server_factory(repeat=1, announce=len(EXPECTED))
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda _p: Usage(10**9, 10**9 - 10**6, 10**6))
    with pytest.raises(ModelFetchError, match="not enough disk space"):
        fetch.download_file(srv.url, tmp_path / "m.whl", sha256=hashlib.sha256(EXPECTED).hexdigest(),
                            size=len(EXPECTED))
    assert not list(tmp_path.iterdir())
    assert srv.sent <= len(EXPECTED)


def test_good_download_lands_and_the_directory_is_synced(server_factory, tmp_path: Path, monkeypatch):
    srv = server_factory(repeat=1, announce=len(EXPECTED))
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    dirs: list[str] = []
    real_open = os.open
    monkeypatch.setattr(fsutil.os, "fsync", fsync)
    monkeypatch.setattr(fsutil.os, "open", lambda p, flags, *a: dirs.append(str(p)) or real_open(p, flags, *a))
    dest = tmp_path / "m.whl"
    fetch.download_file(srv.url, dest, sha256=hashlib.sha256(EXPECTED).hexdigest(), size=len(EXPECTED))
    assert dest.read_bytes() == EXPECTED
    assert str(tmp_path) in dirs and len(synced) >= 2   # the file, then its directory
