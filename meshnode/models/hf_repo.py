"""Hugging Face names: ``hf:OWNER/REPO[@REVISION]/PATH.gguf`` (one file) and
``hf:OWNER/REPO[@REVISION][:QUANT]`` (the repository's GGUF of that quantization).

Theory of operation. Sans-IO (meshnode.models.url_fetch does the requests):
:func:`parse_hf` reads what the user typed, :func:`file_url` and :func:`listing_url` say where to ask (Hugging Face's
``/resolve/`` download URLs and its ``/api/models/.../tree`` listing, under
``$HF_ENDPOINT`` as huggingface_hub reads it, https://huggingface.co by default), and
:func:`choose` picks the files of one model from a listing (:func:`parse_listing`, which
trusts nothing in the JSON): the files whose name carries the quantization as a whole
word (``Q4_K_M`` in ``Qwen2.5-7B-Instruct-Q4_K_M.gguf``, any case), every part of a split
model, first part first, with the sha256 the repository gives each file (its LFS object
id) so a download is checked file by file. No quantization: the repository's only model,
else ``Q4_K_M`` (what llama.cpp's ``-hf`` picks too). Vision projectors (``mmproj``) are
never picked. Anything ambiguous or missing is an error that lists what there is.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import PurePosixPath

from meshnode.gguf_files import split_name, split_part_name
from meshnode.models.errors import ModelFetchError

__all__ = ["DEFAULT_QUANT", "HfSpec", "RepoFile", "choose", "endpoint", "file_url", "listing_url",
           "parse_hf", "parse_listing"]

PREFIX = "hf:"
DEFAULT_QUANT = "Q4_K_M"
ENDPOINT_ENV = "HF_ENDPOINT"
MAX_LISTING_BYTES = 16 << 20      # a repository's file list (the largest hold a few thousand files)
_NAME = r"[A-Za-z0-9][\w.-]{0,95}"
_FILE_FORM = re.compile(rf"^hf:(?P<owner>{_NAME})/(?P<repo>{_NAME})(?:@(?P<rev>[\w.-]{{1,128}}))?/(?P<path>[^?#]+\.gguf)$")
_REPO_FORM = re.compile(rf"^hf:(?P<owner>{_NAME})/(?P<repo>{_NAME})(?:@(?P<rev>[\w.-]{{1,128}}))?(?::(?P<quant>[\w.-]{{1,32}}))?$")


@dataclass(frozen=True, slots=True)
class HfSpec:
    owner: str
    repo: str
    rev: str
    path: str | None       # one file; None: pick by ``quant``
    quant: str | None


@dataclass(frozen=True, slots=True)
class RepoFile:
    path: str              # in the repository
    size: int
    sha256: str | None     # its LFS object id, when the listing gives one

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name


def parse_hf(spec: str) -> HfSpec | None:
    """``spec`` read as a Hugging Face name, None when it is not one (no ``hf:``).
    Raises ModelFetchError for a malformed one."""
    if not spec.startswith(PREFIX):
        return None
    m = _FILE_FORM.match(spec)
    if m is not None and ".." not in PurePosixPath(m["path"]).parts:
        return HfSpec(m["owner"], m["repo"], m["rev"] or "main", m["path"], None)
    m = _REPO_FORM.match(spec)
    if m is not None:
        return HfSpec(m["owner"], m["repo"], m["rev"] or "main", None, m["quant"])
    raise ModelFetchError(f"{spec!r}: write hf:OWNER/REPO[:QUANT] (e.g. hf:bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M) "
                          "or hf:OWNER/REPO[@REVISION]/FILE.gguf")


def endpoint() -> str:
    return (os.environ.get(ENDPOINT_ENV, "").strip() or "https://huggingface.co").rstrip("/")


def file_url(spec: HfSpec, path: str) -> str:
    rev = urllib.parse.quote(spec.rev, safe="")
    return f"{endpoint()}/{spec.owner}/{spec.repo}/resolve/{rev}/{urllib.parse.quote(path)}"


def listing_url(spec: HfSpec) -> str:
    rev = urllib.parse.quote(spec.rev, safe="")
    return f"{endpoint()}/api/models/{spec.owner}/{spec.repo}/tree/{rev}?recursive=true"


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def parse_listing(data: bytes) -> list[RepoFile]:
    """The .gguf files of a repository listing (the tree API's JSON array). Entries that
    are not files, or not shaped as expected, are skipped; a body that is not a JSON array
    is a ModelFetchError."""
    try:
        items = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        items = None
    if not isinstance(items, list):
        raise ModelFetchError("the repository listing is not what Hugging Face sends (a JSON array of files)")
    out = []
    for it in items:
        if not isinstance(it, dict) or it.get("type") != "file":
            continue
        path, size = it.get("path"), it.get("size")
        if not isinstance(path, str) or not path.endswith(".gguf") or not isinstance(size, int) or size < 0:
            continue
        lfs = it.get("lfs")
        oid = lfs.get("oid") if isinstance(lfs, dict) else None
        out.append(RepoFile(path, size, oid if isinstance(oid, str) and _SHA256.match(oid) else None))
    return out


def _models(files: list[RepoFile]) -> dict[str, list[RepoFile]]:
    """The repository's models by the path of their first file: single files, and split
    models' parts in order (a split model missing a part is left out)."""
    by_path = {f.path: f for f in files}
    out: dict[str, list[RepoFile]] = {}
    for f in files:
        split = split_name(f.path)
        if split is None:
            out[f.path] = [f]
        elif split[1] == 1:
            prefix, _, count = split
            parts = [by_path.get(split_part_name(prefix, i, count)) for i in range(1, count + 1)]
            if all(p is not None for p in parts):
                out[f.path] = parts   # type: ignore[assignment]
    return {k: v for k, v in out.items() if "mmproj" not in PurePosixPath(k).name.lower()}


def _has_quant(name: str, quant: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", name, re.IGNORECASE) is not None


def choose(files: list[RepoFile], quant: str | None, repo: str = "the repository") -> list[RepoFile]:
    """The files of the one model ``quant`` names in a listing (module docstring)."""
    models = _models(files)
    if not models:
        raise ModelFetchError(f"{repo} holds no GGUF model")
    if quant is None and len(models) == 1:
        return next(iter(models.values()))
    want = quant or DEFAULT_QUANT
    found = [parts for path, parts in models.items() if _has_quant(PurePosixPath(path).name, want)]
    if len(found) == 1:
        return found[0]
    listed = ", ".join(sorted(PurePosixPath(p).name for p in models)[:12]) + (", ..." if len(models) > 12 else "")
    if not found:
        how = f"no model of {want}" + ("" if quant else " (the default; name one with :QUANT)")
        raise ModelFetchError(f"{repo} has {how}; it has: {listed}")
    raise ModelFetchError(f"{repo} has {len(found)} models of {want}: name the file "
                          f"(hf:OWNER/REPO/FILE.gguf); it has: {listed}")
