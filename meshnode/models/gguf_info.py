"""GGUF metadata: what a model file is, read without loading its weights.

:func:`open_gguf` wraps :class:`~meshnode.gguf_reader.BulkReader` (a
:class:`gguf.GGUFReader` that parses big metadata arrays in bulk; it memory-maps the
file, so nothing is read until touched) and turns every way a file can be wrong into a
:class:`~meshnode.models.errors.ModelFileError` naming the file: missing, empty, not GGUF
(bad magic), an unsupported GGUF version, or truncated (header or tensor data running past
the end of the file). :func:`read_model_info` then summarises the file as a frozen
:class:`GGUFInfo`: architecture, block count, widths, vocabulary, chat template and the
tensor list grouped by block.

Split models. A model too big for one file comes as parts written by llama.cpp's
``llama-gguf-split`` (or gguf-py): ``<name>-00001-of-0000N.gguf`` ... each holding
``split.no``, ``split.count`` and ``split.tensors.count``; the first part holds every
other metadata key. The first part's path stands for the model everywhere (llama.cpp
loads the others from beside it by the same naming): :func:`open_gguf` opens every part
and returns a :class:`SplitReader`, which reads as one file (the first part's metadata
without the ``split.*`` keys, every part's tensors in order), so slicing, the planner and
``models info`` need nothing else; a later part given alone is refused naming the first.
:mod:`meshnode.gguf_files` lists a model's files by name alone (what sizes, hashes and
record checks go by).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType, LlamaFileType

from meshnode.gguf_files import MAX_SPLIT_PARTS, model_size, split_part, split_part_name, split_part_path
from meshnode.gguf_reader import PARSE_ERRORS, BulkReader
from meshnode.models.errors import ModelFileError

GGUF_MAGIC = b"GGUF"
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")

__all__ = [
    "GGUFInfo",
    "TensorEntry",
    "SplitReader",
    "block_index",
    "field_value",
    "open_gguf",
    "read_model_info",
    "require_field",
]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a GGUF: name, ggml type name, shape (ggml order: ne0 first), bytes."""

    name: str
    type: str
    shape: tuple[int, ...]
    n_bytes: int


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    """Summary of one GGUF model file."""

    path: Path
    architecture: str
    n_layers: int                     # {arch}.block_count
    n_embd: int                       # {arch}.embedding_length
    n_vocab: int                      # {arch}.vocab_size, else len(tokenizer tokens), else token_embd
    size: int                         # bytes of the file (of every part of a split model)
    file_type: int | None             # general.file_type (llama_ftype), None when absent
    chat_template: str | None         # tokenizer.chat_template
    name: str | None                  # general.name
    tokenizer_model: str | None       # tokenizer.ggml.model ("gpt2", "llama", "none", ...)
    blocks: tuple[tuple[TensorEntry, ...], ...]  # blocks[i]: tensors named blk.{i}.*
    other_tensors: tuple[TensorEntry, ...]       # token_embd, output_norm, output, ...

    @property
    def file_type_name(self) -> str | None:
        """``general.file_type`` as a name like ``MOSTLY_Q4_1`` (None when absent/unknown)."""
        if self.file_type is None:
            return None
        try:
            return LlamaFileType(self.file_type).name
        except ValueError:
            return None

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t.name for blk in self.blocks for t in blk) | frozenset(
            t.name for t in self.other_tensors
        )

    @property
    def tied_embeddings(self) -> bool:
        """True when there is no ``output.weight``: llama.cpp uses token_embd as the head."""
        return "output.weight" not in self.tensor_names

    @property
    def n_tensor_bytes(self) -> int:
        return sum(t.n_bytes for blk in self.blocks for t in blk) + sum(
            t.n_bytes for t in self.other_tensors
        )


SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


class SplitReader:
    """The parts of a split model read as one GGUF (module docstring): ``fields`` are the
    first part's without the ``split.*`` keys, ``tensors`` every part's in order. Has what
    meshnode reads of a :class:`gguf.GGUFReader`: ``fields``, ``get_field``, ``tensors``,
    ``byte_order``."""

    def __init__(self, parts: list[GGUFReader], paths: list[Path]) -> None:
        self.parts = parts
        self.paths = paths
        self.fields = {k: v for k, v in parts[0].fields.items() if k not in SPLIT_KEYS}
        self.tensors = [t for r in parts for t in r.tensors]
        self.byte_order = parts[0].byte_order

    def get_field(self, key: str) -> Any:
        return self.fields.get(key)


def block_index(tensor_name: str) -> int | None:
    """The block number of ``blk.{i}.*`` tensor names, None for the others."""
    m = _BLOCK_RE.match(tensor_name)
    return int(m.group(1)) if m else None


def open_gguf(path: str | os.PathLike[str]) -> Any:
    """Open ``path`` with :class:`~meshnode.gguf_reader.BulkReader` (memory-mapped, read-only);
    the first part of a split model opens every part, as a :class:`SplitReader`.

    Raises :class:`ModelFileError` (naming the file) when it is missing, not a regular
    file, empty, not GGUF, of an unsupported version, or truncated; for a split model also
    when a part is missing or not the part its name says, or a later part is given.
    """
    p = Path(path)
    reader = _open_one(p)
    count = field_value(reader, "split.count")
    if count is None or count == 1:
        return reader
    no = field_value(reader, "split.no")
    where = split_part(p)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 < count <= MAX_SPLIT_PARTS \
            or not isinstance(no, int) or isinstance(no, bool) or not 0 <= no < count:
        raise ModelFileError(f"{p}: bad split metadata (split.no {no!r}, split.count {count!r})")
    if where is None or where != (no + 1, count):
        raise ModelFileError(f"{p} is part {no + 1} of {count} of a split model but not named as one "
                             f"(llama.cpp finds the parts by name: {split_part_name('<name>', no + 1, count)})")
    if no != 0:
        first = split_part_path(p, 1, count)
        raise ModelFileError(f"{p} is part {no + 1} of {count} of a split model: give its first part, {first.name}")
    parts, paths = [reader], [p]
    for i in range(2, count + 1):
        q = split_part_path(p, i, count)
        if not q.exists():
            raise ModelFileError(f"{p} is part 1 of {count} of a split model, but part {i} is missing: {q}")
        r = _open_one(q)
        if (field_value(r, "split.no"), field_value(r, "split.count")) != (i - 1, count):
            raise ModelFileError(f"{q} is not part {i} of {count} of {p.name}'s model (its split metadata differ)")
        if r.byte_order != reader.byte_order:
            raise ModelFileError(f"{q}: its byte order differs from the first part's")
        parts.append(r)
        paths.append(q)
    split = SplitReader(parts, paths)
    names = [t.name for t in split.tensors]
    declared = field_value(reader, "split.tensors.count")
    if len(set(names)) != len(names) or (isinstance(declared, int) and declared != len(names)):
        raise ModelFileError(f"{p}: the parts of this split model hold {len(names)} tensors "
                             f"({len(set(names))} names), its metadata says {declared}")
    return split


def _open_one(p: Path) -> GGUFReader:
    """One GGUF file (:func:`open_gguf` without the split model's parts)."""
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ModelFileError(f"model file not found: {p}") from None
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {p}: {exc.strerror or exc}") from None
    if not p.is_file():
        raise ModelFileError(f"not a file: {p}")
    if st.st_size < 24:  # magic + version + tensor count + kv count
        raise ModelFileError(f"{p} is not a GGUF file (only {st.st_size} bytes)")
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {p}: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{p} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = BulkReader(p, "r")
    except PARSE_ERRORS as exc:   # a header or tensor table cut short or corrupt
        msg = str(exc)
        if "version" in msg:
            raise ModelFileError(f"{p}: unsupported GGUF file ({msg})") from None
        raise ModelFileError(
            f"{p} is truncated or corrupt (the GGUF reader failed: {msg})"
        ) from None
    # The reader does not check that tensor data lies inside the file when the cut falls
    # exactly in padding; check every tensor's extent explicitly.
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=reader.data_offset)
    if end > st.st_size:
        raise ModelFileError(
            f"{p} is truncated: tensor data needs {end} bytes, the file has {st.st_size}"
        )
    return reader


def field_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The decoded value of metadata ``key`` (str, int, float, bool or list), or ``default``."""
    field = reader.get_field(key)
    if field is None:
        return default
    if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.types) > 2:
        return default  # nested arrays: not used by anything we read
    return field.contents()


def require_field(reader: GGUFReader, key: str, path: Path, kind: type = int) -> Any:
    """Like :func:`field_value` but a missing or mistyped key is a :class:`ModelFileError`."""
    value = field_value(reader, key)
    if value is None:
        raise ModelFileError(f"{path}: missing GGUF metadata key '{key}'")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ModelFileError(f"{path}: metadata key '{key}' should be an integer, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise ModelFileError(f"{path}: metadata key '{key}' should be a string, got {value!r}")
    return value


def read_model_info(path: str | os.PathLike[str]) -> GGUFInfo:
    """Read the summary of a GGUF model file.

    Raises :class:`ModelFileError` for unreadable, non-GGUF or truncated files and for a
    missing ``general.architecture``, ``{arch}.block_count`` or ``{arch}.embedding_length``.
    """
    p = Path(path)
    reader = open_gguf(p)
    return info_from_reader(reader, p)


def info_from_reader(reader: GGUFReader, path: Path) -> GGUFInfo:
    """:func:`read_model_info` for an already opened reader."""
    arch = require_field(reader, "general.architecture", path, str)
    n_layers = require_field(reader, f"{arch}.block_count", path)
    n_embd = require_field(reader, f"{arch}.embedding_length", path)

    blocks: list[list[TensorEntry]] = [[] for _ in range(n_layers)]
    others: list[TensorEntry] = []
    by_name: dict[str, TensorEntry] = {}
    for t in reader.tensors:
        entry = TensorEntry(t.name, t.tensor_type.name, tuple(int(x) for x in t.shape), int(t.n_bytes))
        by_name[t.name] = entry
        i = block_index(t.name)
        if i is None:
            others.append(entry)
        elif i >= n_layers:
            raise ModelFileError(
                f"{path}: tensor '{t.name}' is beyond {arch}.block_count = {n_layers}"
            )
        else:
            blocks[i].append(entry)

    n_vocab = field_value(reader, f"{arch}.vocab_size")
    if not isinstance(n_vocab, int):
        tokens = reader.get_field("tokenizer.ggml.tokens")
        if tokens is not None:
            n_vocab = len(tokens.data)
        elif "token_embd.weight" in by_name and len(by_name["token_embd.weight"].shape) == 2:
            n_vocab = by_name["token_embd.weight"].shape[1]
        else:
            raise ModelFileError(
                f"{path}: cannot tell the vocabulary size (no '{arch}.vocab_size', "
                "no tokenizer.ggml.tokens, no token_embd.weight)"
            )

    file_type = field_value(reader, "general.file_type")
    chat_template = field_value(reader, "tokenizer.chat_template")
    name = field_value(reader, "general.name")
    tok_model = field_value(reader, "tokenizer.ggml.model")
    return GGUFInfo(
        path=path,
        architecture=arch,
        n_layers=n_layers,
        n_embd=n_embd,
        n_vocab=int(n_vocab),
        size=model_size(path),
        file_type=file_type if isinstance(file_type, int) else None,
        chat_template=chat_template if isinstance(chat_template, str) else None,
        name=name if isinstance(name, str) else None,
        tokenizer_model=tok_model if isinstance(tok_model, str) else None,
        blocks=tuple(tuple(b) for b in blocks),
        other_tensors=tuple(others),
    )
