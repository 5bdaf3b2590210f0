"""Fetching a GGUF by URL into the store, resumable: ``meshnode models fetch URL`` and
``serve --model URL``.

Theory of operation. :func:`is_model_url` reads what the user typed: an ``http(s)://``
URL of a ``.gguf`` file, or a Hugging Face name (:mod:`meshnode.models.hf_repo`):
``hf:OWNER/REPO[@REVISION]/PATH.gguf`` is that file's download URL, and
``hf:OWNER/REPO[:QUANT]`` picks the repository's model of that quantization from its
listing, each file then checked against the sha256 the listing gives (a model fetched so
is found in the store again by the name typed, without the network). :func:`fetch_url`
puts the file under ``<models>/<name>/<file>`` (the name is the
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
huggingface.co (and to ``$HF_ENDPOINT``'s host) for gated and private models, never to
the host a download is redirected to.

URLs are fetched only for what the user typed on this machine (``models fetch``,
``serve --model``): never for names that come from the network or from a model package.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import logging
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshnode.fsutil import CHUNK, fsync_dir
from meshnode.models import hf_repo
from meshnode.models.errors import ChecksumError, ModelFetchError, ModelFileError
from meshnode.models.fetch import DOWNLOAD_TIMEOUT_S, check_free_space
from meshnode.gguf_files import model_files
from meshnode.models.index import (
    FETCH_NOTE, STORE_NAME, ModelRef, file_record, record_path, store_entries, store_name, vouch_for,
)
from meshnode.models.progress import ProgressFn
from meshnode.paths import NodePaths

__all__ = ["DOWNLOAD_SUFFIX", "fetch_url", "is_model_url", "model_url", "stopped_downloads"]

log = logging.getLogger(__name__)

DOWNLOAD_SUFFIX = ".download"        # a file being downloaded, kept to resume
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,250}\.gguf$")
SPACE_CHECK_BYTES = 256 << 20        # without an announced size, the disk is checked this often


def is_model_url(spec: str) -> bool:
    """``spec`` names a model to download (an http(s) URL of a .gguf file, or a Hugging
    Face name ``hf:...``); raises ModelFetchError for one that cannot be a model's."""
    if hf_repo.parse_hf(spec) is not None:
        return True
    return model_url(spec) is not None


def model_url(spec: str) -> str | None:
    """The download URL of a one-file ``spec`` (an http(s) URL of a .gguf file, or
    ``hf:OWNER/REPO[@REVISION]/FILE.gguf``), or None (not a URL, or a Hugging Face name
    that picks its file from the repository's listing). Raises ModelFetchError for one
    that cannot be a model's."""
    hf = hf_repo.parse_hf(spec)
    if hf is not None:
        return hf_repo.file_url(hf, hf.path) if hf.path is not None else None
    if not spec.lower().startswith(("http://", "https://")):
        return None
    _file_name(spec)
    return _download_page(spec)


def _download_page(url: str) -> str:
    """A Hugging Face file page's URL (``/OWNER/REPO/blob/REV/FILE``, what its web page's
    address bar shows) as its download URL (``/resolve/``): the page is HTML."""
    parts = urllib.parse.urlsplit(url)
    segments = parts.path.split("/")
    if parts.hostname in _token_hosts() and len(segments) > 4 and segments[3] == "blob":
        segments[3] = "resolve"
        return urllib.parse.urlunsplit(parts._replace(path="/".join(segments)))
    return url


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
    """The model at URL ``spec`` (:func:`is_model_url`) in the store, downloaded unless it is
    there already; resumes a download that stopped (module docstring).

    Raises ModelFetchError (network, disk, a bad URL or name; what arrived stays to resume),
    ChecksumError (not ``sha256``; deleted) or ModelFileError (not a GGUF; deleted)."""
    hf, url, listed = hf_repo.parse_hf(spec), model_url(spec), []
    if url is None and hf is None:
        raise ModelFetchError(f"{spec!r} is not a model URL (http(s)://.../FILE.gguf or hf:OWNER/REPO[:QUANT])")
    if url is None:   # hf:OWNER/REPO[:QUANT]: the file comes from the repository's listing
        if sha256 is None and (ref := _fetched_before(paths, spec)) is not None:
            return ref
        url, listed = _from_listing(hf, opener, timeout)   # type: ignore[arg-type]
    expect = {f.name: f.sha256 for f in listed if f.sha256}
    if listed:
        log.info("%s is %s (%d file%s, %.2f GB)", spec, listed[0].path, len(listed), "s" if len(listed) > 1 else "",
                 sum(f.size for f in listed) / 1e9)
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
    if listed:   # every file's size is known: room for all of them, before the first byte
        check_free_space(dest.parent, sum(f.size for f in listed) - _held(dest.parent), what=f"fetch {name}")
    with _only_fetch(note, spec):
        whole = hashlib.sha256()
        try:
            for i, f in enumerate(files, 1):
                phase = "download" if len(files) == 1 else f"download {i}/{len(files)}"
                whole = _download(_part_url(url, f.name), f, whole, expect.get(f.name), phase, progress, opener,
                                  timeout)
        except ModelFetchError:
            if not any(f != note for f in dest.parent.iterdir()):   # not a byte arrived: nothing to resume
                note.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    dest.parent.rmdir()
            raise
    sha = whole.hexdigest()
    try:
        if sha256 is not None and sha != sha256.lower():
            raise ChecksumError(f"{url} has sha256 {sha}, expected {sha256}: the files were deleted")
        ref = vouch_for(dest, sha, dest.parent.name, {"source": {"url": url, "spec": spec}})   # (deletes dest if not a GGUF)
    except (ChecksumError, ModelFileError):
        for f in files:
            f.unlink(missing_ok=True)
        note.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            dest.parent.rmdir()
        raise
    note.unlink(missing_ok=True)
    return ref


def _fetched_before(paths: NodePaths, spec: str) -> ModelRef | None:
    """The model in the store that ``spec`` fetched (its record says so), else None: a
    name that picks its file from a listing needs no network once fetched."""
    for name, gguf in store_entries(paths):
        with contextlib.suppress(OSError, ValueError):
            source = json.loads(record_path(gguf).read_text()).get("source")
            if isinstance(source, dict) and source.get("spec") == spec:
                return file_record(gguf, record_path(gguf), name, progress=None)
    return None


def _from_listing(hf: hf_repo.HfSpec, opener: Callable[..., Any], timeout: float
                  ) -> tuple[str, list[hf_repo.RepoFile]]:
    """(the URL of the first file, every file) of the model ``hf`` picks from its
    repository's listing."""
    url = hf_repo.listing_url(hf)
    try:
        with opener(urllib.request.Request(url, headers=_headers(url)), timeout=timeout) as resp:
            data = resp.read(hf_repo.MAX_LISTING_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise ModelFetchError(f"cannot list {hf.owner}/{hf.repo}: HTTP {exc.code} {exc.reason}{_hint(url, exc.code)}") from None
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as exc:
        raise ModelFetchError(f"cannot list {hf.owner}/{hf.repo}: {getattr(exc, 'reason', None) or exc}") from None
    if len(data) > hf_repo.MAX_LISTING_BYTES:
        raise ModelFetchError(f"the listing of {hf.owner}/{hf.repo} is over {hf_repo.MAX_LISTING_BYTES >> 20} MiB")
    files = hf_repo.choose(hf_repo.parse_listing(data), hf.quant, f"{hf.owner}/{hf.repo}")
    return hf_repo.file_url(hf, files[0].path), files


def _headers(url: str) -> dict[str, str]:
    """A request's headers: who asks, and the Hugging Face token for its own host."""
    from meshnode import __version__

    headers = {"User-Agent": f"meshnode/{__version__}"}
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token and urllib.parse.urlsplit(url).hostname in _token_hosts():
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _token_hosts() -> frozenset[str]:
    host = urllib.parse.urlsplit(hf_repo.endpoint()).hostname
    return TOKEN_HOSTS | ({host} if host else set())


def _hint(url: str, code: int) -> str:
    if code in (401, 403) and urllib.parse.urlsplit(url).hostname in _token_hosts():
        return (f" (a gated or private model: accept its terms on its page and set {TOKEN_ENV} "
                "to an access token, https://huggingface.co/settings/tokens)")
    return ""


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


def _held(folder: Path) -> int:
    """Bytes of the files in ``folder`` (a stopped fetch's, which a resume keeps)."""
    total = 0
    for f in folder.iterdir():
        with contextlib.suppress(OSError):
            total += f.stat().st_size
    return total


def stopped_downloads(paths: NodePaths) -> list[tuple[str, Path, int, str]]:
    """(store name, its folder, bytes there, what the user typed) of each fetch by URL that
    stopped before its model was whole: never listed as a model, resumed by the same
    ``models fetch``, removed by ``models rm``."""
    out = []
    for note in sorted(paths.models.glob(f"*/{FETCH_NOTE}")) if paths.models.is_dir() else ():
        folder = note.parent
        with contextlib.suppress(OSError, UnicodeDecodeError):
            out.append((folder.name, folder, _held(folder), note.read_text().strip()[:500]))
    return out


def _hash_file(path: Path, *hashes: Any) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            for h in hashes:
                h.update(chunk)


def _download(url: str, dest: Path, whole: Any, expect: str | None, phase: str, progress: ProgressFn | None,
              opener: Callable[..., Any], timeout: float) -> Any:
    """``url`` to ``dest`` through ``dest.download`` (resumed when there); returns
    ``whole`` (a sha256) fed with the file's bytes. ``expect``: the file's own sha256, as
    its repository lists it (a file that differs is deleted: ChecksumError)."""
    own = hashlib.sha256()
    if dest.is_file():   # a part of a split model fetched by an earlier, stopped run
        _hash_file(dest, whole, own)
        _check(own, expect, dest, url)
        return whole
    part = dest.with_name(dest.name + DOWNLOAD_SUFFIX)
    part.parent.mkdir(parents=True, exist_ok=True)
    before = whole.copy()
    have = part.stat().st_size if part.is_file() else 0
    if have:
        _hash_file(part, whole, own)
    headers = _headers(url)
    if have:
        headers["Range"] = f"bytes={have}-"
    done, total = have, None
    try:
        with opener(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
            status = getattr(resp, "status", 200)
            total = _resumed_total(resp, have, url) if status == 206 else None
            if status != 206 and have:   # the server sends the whole file: start it over
                done, have, whole, own = 0, 0, before, hashlib.sha256()
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
                    own.update(chunk)
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
        raise ModelFetchError(f"cannot download {url}: HTTP {exc.code} {exc.reason}{_hint(url, exc.code)}") from None
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as exc:
        reason = getattr(exc, "reason", None) or exc
        if not done:
            raise ModelFetchError(f"cannot download {url}: {reason}") from None
        raise ModelFetchError(f"download of {url} stopped at {done} of {total or '?'} bytes ({reason}); "
                              "the same command resumes it") from None
    except OSError as exc:
        raise ModelFetchError(f"cannot download {url} to {part}: {exc}") from None
    _check(own, expect, part, url)
    os.replace(part, dest)
    fsync_dir(dest.parent)
    return whole


def _check(own: Any, expect: str | None, path: Path, url: str) -> None:
    if expect is not None and own.hexdigest() != expect:
        path.unlink(missing_ok=True)
        raise ChecksumError(f"{url} has sha256 {own.hexdigest()}, its repository lists {expect}: "
                            "deleted; fetch it again")


_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def _resumed_total(resp: Any, have: int, url: str) -> int | None:
    """The file's size from a 206 answer to ``Range: bytes=have-`` (None: not told);
    a range that does not start at ``have`` is refused."""
    m = _CONTENT_RANGE.match(resp.headers.get("Content-Range", "").strip())
    if m is None or int(m[1]) != have:
        raise ModelFetchError(f"{url} answered a resumed download with the range "
                              f"{resp.headers.get('Content-Range')!r}, not bytes {have}-")
    return None if m[3] == "*" else int(m[3])
