"""Fetching a GGUF by URL into the store, resumable: ``meshnode models fetch URL`` and
``serve --model URL``.

Theory of operation. :func:`model_url` reads what the user typed: an ``http(s)://`` URL
of a ``.gguf`` file, or ``hf:OWNER/REPO[@REVISION]/PATH.gguf`` (Hugging Face's download
URL, ``https://huggingface.co/OWNER/REPO/resolve/REVISION/PATH``, revision ``main`` by
default). :func:`fetch_url` puts the file under ``<models>/<name>/<file>`` (the name is the
file's, less a split model's part suffix, or ``name=``) and records it
(:mod:`meshnode.models.index`); a first part of a split model
(``-00001-of-0000N.gguf``, docs/models.md) brings every part, from the same folder URL.
A file already in the store is not fetched again.

Each file downloads into ``<file>.download`` beside its place and is renamed when whole,
so a download that stopped (network, Ctrl-C, a reboot) resumes where it stopped the next
time: the bytes there are hashed again and an HTTP ``Range`` request asks for the rest;
a server that ignores it (200) starts the file over. The model's sha256 (of its parts
one after another) is computed while the bytes arrive and checked against ``sha256=``
when given; the file must then read as a GGUF (every part), or it is deleted. What the
server sends is bounded by what it announced (Content-Length / Content-Range), and
without an announcement by the disk's free space (checked every 256 MiB), so a server
cannot fill the disk. ``HF_TOKEN`` (a Hugging Face access token) is sent to
huggingface.co for gated and private models, never to the host a download is redirected
to.

URLs are fetched only for what the user typed on this machine (``models fetch``,
``serve --model``): never for names that come from the network or from a model package.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshnode.fsutil import CHUNK, fsync_dir
from meshnode.models.errors import ChecksumError, ModelFetchError, ModelFileError
from meshnode.models.fetch import DOWNLOAD_TIMEOUT_S, check_free_space
from meshnode.gguf_files import model_files
from meshnode.models.index import FETCH_NOTE, STORE_NAME, ModelRef, file_record, record_path, store_name, vouch_for
from meshnode.models.progress import ProgressFn
from meshnode.paths import NodePaths

__all__ = ["DOWNLOAD_SUFFIX", "fetch_url", "model_url", "stopped_downloads"]

DOWNLOAD_SUFFIX = ".download"        # a file being downloaded, kept to resume
HF_PREFIX = "hf:"
_HF = re.compile(r"^hf:(?P<owner>[\w.-]+)/(?P<repo>[\w.-]+)(?:@(?P<rev>[\w.\-/]+?))?/(?P<path>.+\.gguf)$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,250}\.gguf$")
SPACE_CHECK_BYTES = 256 << 20        # without an announced size, the disk is checked this often


def model_url(spec: str) -> str | None:
    """The download URL ``spec`` names (an http(s) URL of a .gguf file, or ``hf:...``), or
    None when it is no URL. Raises ModelFetchError for one that cannot be a model's."""
    if spec.startswith(HF_PREFIX):
        m = _HF.match(spec)
        if m is None:
            raise ModelFetchError(f"{spec!r}: write hf:OWNER/REPO/FILE.gguf (or hf:OWNER/REPO@REVISION/FILE.gguf)")
        rev = m["rev"] or "main"
        return (f"https://huggingface.co/{m['owner']}/{m['repo']}/resolve/{urllib.parse.quote(rev, safe='')}/"
                f"{urllib.parse.quote(m['path'])}")
    if not spec.lower().startswith(("http://", "https://")):
        return None
    _file_name(spec)
    return spec


def _file_name(url: str) -> str:
    """The file name at the end of ``url``'s path (checked: a plain .gguf name)."""
    path = urllib.parse.urlsplit(url).path
    name = urllib.parse.unquote(path.rsplit("/", 1)[-1])
    if not _FILE_NAME.match(name):
        raise ModelFetchError(f"{url}: the URL must end with a .gguf file name (letters, digits, '.', '_', '+', '-')")
    return name


def _part_url(url: str, name: str) -> str:
    """``url`` with its file name replaced by ``name`` (a split model's other parts)."""
    parts = urllib.parse.urlsplit(url)
    folder = parts.path.rsplit("/", 1)[0]
    return urllib.parse.urlunsplit(parts._replace(path=f"{folder}/{urllib.parse.quote(name)}"))


# Hosts that get the user's Hugging Face token (HF_TOKEN), for gated and private models
TOKEN_HOSTS = frozenset({"huggingface.co"})
TOKEN_ENV = "HF_TOKEN"


class _NoAuthElsewhere(urllib.request.HTTPRedirectHandler):
    """Follows redirects (Hugging Face sends downloads to its CDN) without taking the
    token to another host; a Range header goes along."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).hostname != urllib.parse.urlsplit(req.full_url).hostname:
            new.remove_header("Authorization")
        return new


def _urlopen(req: urllib.request.Request, timeout: float) -> Any:
    return urllib.request.build_opener(_NoAuthElsewhere).open(req, timeout=timeout)


def fetch_url(
    spec: str, paths: NodePaths, *, name: str | None = None, sha256: str | None = None,
    progress: ProgressFn | None = None, opener: Callable[..., Any] = _urlopen,
    timeout: float = DOWNLOAD_TIMEOUT_S,
) -> ModelRef:
    """The model at URL ``spec`` (:func:`model_url`) in the store, downloaded unless it is
    there already; resumes a download that stopped (module docstring).

    Raises ModelFetchError (network, disk, a bad URL or name; what arrived stays to resume),
    ChecksumError (not ``sha256``; deleted) or ModelFileError (not a GGUF; deleted)."""
    url = model_url(spec)
    if url is None:
        raise ModelFetchError(f"{spec!r} is not a model URL (http(s)://.../FILE.gguf or hf:OWNER/REPO/FILE.gguf)")
    file_name = _file_name(url)
    name = name or store_name(Path(file_name))
    if not STORE_NAME.fullmatch(name):
        raise ModelFetchError(f"--name {name!r}: use letters, digits, '.', '_', '+' and '-' "
                              "(starting with a letter or digit), at most 128 characters")
    dest = paths.models / name / file_name
    files = model_files(dest)
    note = dest.parent / FETCH_NOTE
    if sha256 is None and not note.exists() and all(f.is_file() for f in files):
        return file_record(dest, record_path(dest), dest.parent.name, progress=progress)
    others = sorted(set(dest.parent.glob("*.gguf")) - set(files)) if dest.parent.is_dir() else []
    if others:
        raise ModelFetchError(f"{name} is already in the store with another file ({others[0]}): "
                              "pick another --name, or `meshnode models rm` it first")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _only_fetch(note, spec):
        whole = hashlib.sha256()
        for i, f in enumerate(files, 1):
            phase = "download" if len(files) == 1 else f"download {i}/{len(files)}"
            whole = _download(_part_url(url, f.name), f, whole, phase, progress, opener, timeout)
    sha = whole.hexdigest()
    try:
        if sha256 is not None and sha != sha256.lower():
            raise ChecksumError(f"{url} has sha256 {sha}, expected {sha256}: the files were deleted")
        ref = vouch_for(dest, sha, dest.parent.name, {"source": {"url": url}})   # (deletes dest if not a GGUF)
    except (ChecksumError, ModelFileError):
        for f in files:
            f.unlink(missing_ok=True)
        note.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            dest.parent.rmdir()
        raise
    note.unlink(missing_ok=True)
    return ref


@contextlib.contextmanager
def _only_fetch(note: Path, spec: str) -> Any:
    """Write ``note`` (what `models list` says resumes a stopped fetch) and hold a lock on
    it while the files download: a second fetch of the same model at once (a node's
    ``--model URL`` and a ``models fetch``) would append to the same files."""
    with open(note, "a+") as f:
        try:
            import fcntl

            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:   # (no fcntl: Windows; one fetch at a time is up to the user)
            pass
        except OSError:
            raise ModelFetchError(f"another fetch of {note.parent.name} is running (into {note.parent})") from None
        f.seek(0)
        f.truncate()
        f.write(spec + "\n")
        f.flush()
        yield


def stopped_downloads(paths: NodePaths) -> list[tuple[str, Path, int, str]]:
    """(store name, its folder, bytes there, what the user typed) of each fetch by URL that
    stopped before its model was whole: never listed as a model, resumed by the same
    ``models fetch``, removed by ``models rm``."""
    out = []
    for note in sorted(paths.models.glob(f"*/{FETCH_NOTE}")) if paths.models.is_dir() else ():
        folder = note.parent
        held = 0
        for f in folder.iterdir():
            with contextlib.suppress(OSError):
                st = f.stat()
                held += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
        with contextlib.suppress(OSError, UnicodeDecodeError):
            out.append((folder.name, folder, held, note.read_text().strip()[:500]))
    return out


def _hash_file(path: Path, h: Any) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)


def _download(url: str, dest: Path, whole: Any, phase: str, progress: ProgressFn | None,
              opener: Callable[..., Any], timeout: float) -> Any:
    """``url`` to ``dest`` through ``dest.download`` (resumed when there); returns
    ``whole`` (a sha256) fed with the file's bytes."""
    if dest.is_file():   # a part of a split model fetched by an earlier, stopped run
        _hash_file(dest, whole)
        return whole
    part = dest.with_name(dest.name + DOWNLOAD_SUFFIX)
    part.parent.mkdir(parents=True, exist_ok=True)
    before = whole.copy()
    have = part.stat().st_size if part.is_file() else 0
    if have:
        _hash_file(part, whole)
    from meshnode import __version__

    headers = {"User-Agent": f"meshnode/{__version__}"}
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token and urllib.parse.urlsplit(url).hostname in TOKEN_HOSTS:
        headers["Authorization"] = f"Bearer {token}"
    if have:
        headers["Range"] = f"bytes={have}-"
    done, total = have, None
    try:
        with opener(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
            status = getattr(resp, "status", 200)
            total = _resumed_total(resp, have, url) if status == 206 else None
            if status != 206 and have:   # the server sends the whole file: start it over
                done, have, whole = 0, 0, before
            if total is None:
                length = resp.headers.get("Content-Length")
                total = have + int(length) if length and length.isdigit() else None
            check_free_space(dest.parent, (total - done) if total is not None else None, what=f"download {dest.name}")
            checked = done
            with open(part, "ab" if done else "wb") as out:
                if progress is not None:
                    progress(phase, done, total)
                while chunk := resp.read(CHUNK):
                    done += len(chunk)
                    if total is not None and done > total:
                        raise ModelFetchError(f"{url} sent more than the {total} bytes it announced")
                    if total is None and done - checked >= SPACE_CHECK_BYTES:
                        check_free_space(dest.parent, SPACE_CHECK_BYTES, what=f"download {dest.name}")
                        checked = done
                    whole.update(chunk)
                    out.write(chunk)
                    if progress is not None:
                        progress(phase, done, total)
                out.flush()
                os.fsync(out.fileno())
            if total is not None and done != total:
                raise ConnectionError("the connection ended early")
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:   # asked past the end: the file changed there; start over
            part.unlink(missing_ok=True)
        hint = ""
        if exc.code in (401, 403) and urllib.parse.urlsplit(url).hostname in TOKEN_HOSTS:
            hint = (f" (a gated or private model: accept its terms on its page and set {TOKEN_ENV} "
                    "to an access token, https://huggingface.co/settings/tokens)")
        raise ModelFetchError(f"cannot download {url}: HTTP {exc.code} {exc.reason}{hint}") from None
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ModelFetchError(f"download of {url} stopped at {done} of {total or '?'} bytes ({reason}); "
                              "the same command resumes it") from None
    except OSError as exc:
        raise ModelFetchError(f"cannot download {url} to {part}: {exc}") from None
    os.replace(part, dest)
    fsync_dir(dest.parent)
    return whole


_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def _resumed_total(resp: Any, have: int, url: str) -> int | None:
    """The file's size from a 206 answer to ``Range: bytes=have-`` (None: not told);
    a range that does not start at ``have`` is refused."""
    m = _CONTENT_RANGE.match(resp.headers.get("Content-Range", "").strip())
    if m is None or int(m[1]) != have:
        raise ModelFetchError(f"{url} answered a resumed download with the range "
                              f"{resp.headers.get('Content-Range')!r}, not bytes {have}-")
    return None if m[3] == "*" else int(m[3])
