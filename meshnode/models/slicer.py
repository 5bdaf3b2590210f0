"""Layer slices: a GGUF holding blocks [start, end) of a model, loadable by llama.cpp.

Theory of operation
-------------------
A slice is an ordinary GGUF: blocks ``blk.{i}.*`` for start <= i < end renumbered to
``blk.{i-start}.*``, ``{arch}.block_count = end - start``, every other metadata key kept,
and per-layer metadata arrays (any ``{arch}.*`` array whose length equals the original
block count, e.g. per-layer head counts) cut to [start, end). Tensors are copied raw:
quantized data is copied byte for byte with its ggml type (see :func:`_add_raw_tensor`),
so a slice computes exactly what the same layers compute inside the whole model.

What else a slice keeps depends on its role in the pipeline (docs/engine.md):

- first stage (start == 0): token_embd and the full tokenizer; no ``output.weight``
  (llama.cpp then ties a head to token_embd that the engine never runs).
- middle stage: a tiny vocabulary (``tokenizer.ggml.model = "none"``,
  ``{arch}.vocab_size = 8``, a zero f32 token_embd of shape [n_embd, 8], every other
  ``tokenizer.*`` key dropped, no ``output.weight``): the file shrinks and the logits buffer
  (n_outputs x n_vocab) stops costing memory.
- final stage (end == n): the full tokenizer, ``output.weight`` when the model has one,
  and token_embd (llama.cpp ties the head to it when there is no ``output.weight``, and
  its loader requires token_embd in every case).
- ``output_norm`` is kept in every slice: llama.cpp's loader requires it for all the
  supported architectures (llama, qwen2, qwen3, gemma3 create it without
  TENSOR_NOT_REQUIRED); it is n_embd floats.

Architecture rules (only verified architectures are sliced; others are refused by name):

- llama, qwen2, qwen3: nothing else.
- gemma3: llama.cpp derives the sliding-window pattern from the *local* layer index
  (``load_swa_pattern(ml, 6)``: layer il is SWA iff ``il % 6 < 5``, i.e.
  ``(il + 1) % 6 != 0``, unless ``gemma3.attention.sliding_window_pattern`` is given as a
  per-layer bool array, or as a period). A slice therefore always gets the per-layer bool
  array computed from *global* indices. The 27B model (62 layers) picks its attention
  scale from the layer count, so its slices are refused.

Writes go to a temp file beside ``dest`` and are renamed into place; on any error nothing
is left at ``dest``. :class:`SliceCache` keeps slices under ``NodePaths.slices`` keyed by
(source sha256, range, role), each with a small JSON manifest.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from meshnode.models.errors import ModelFileError, SliceRangeError, UnsupportedArchitectureError
from meshnode.models.gguf_info import block_index, field_value, open_gguf, require_field
from meshnode.models.gguf_write import atomic_gguf_writer, begin_tensor_data
from meshnode.models.progress import ProgressFn, report

if TYPE_CHECKING:
    from meshnode.models.index import ModelRef
    from meshnode.paths import NodePaths

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "gemma3")
TINY_VOCAB = 8
# Bump when the slice format changes: cached slices of older formats are rebuilt.
SLICE_FORMAT_VERSION = 1
# llama.cpp's gemma3 default: load_swa_pattern(ml, 6), dense_first = false.
GEMMA3_DEFAULT_SWA_PERIOD = 6
_GEMMA3_27B_LAYERS = 62

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "DEFAULT_SLICE_QUOTA",
    "SliceCache",
    "StageRole",
    "check_sliceable",
    "gemma3_swa_layers",
    "stage_role",
    "unpin",
    "write_slice",
]


class StageRole(enum.Enum):
    WHOLE = "whole"
    FIRST = "first"
    MIDDLE = "middle"
    FINAL = "final"

    @property
    def keep_embedding(self) -> bool:
        return self in (StageRole.WHOLE, StageRole.FIRST)

    @property
    def keep_head(self) -> bool:
        return self in (StageRole.WHOLE, StageRole.FINAL)


def check_range(start: int, end: int, n_layers: int, what: str = "model") -> None:
    """Raise :class:`SliceRangeError` unless 0 <= start < end <= n_layers."""
    if isinstance(start, bool) or isinstance(end, bool) or not isinstance(start, int) or not isinstance(end, int):
        raise SliceRangeError(f"layer range must be integers, got {start!r}:{end!r}")
    if not 0 <= start < end <= n_layers:
        raise SliceRangeError(
            f"layer range [{start}, {end}) is empty or outside the {what}'s blocks "
            f"[0, {n_layers})"
        )


def stage_role(start: int, end: int, n_layers: int) -> StageRole:
    """The pipeline role of blocks [start, end) of an ``n_layers``-block model."""
    check_range(start, end, n_layers)
    if start == 0 and end == n_layers:
        return StageRole.WHOLE
    if start == 0:
        return StageRole.FIRST
    if end == n_layers:
        return StageRole.FINAL
    return StageRole.MIDDLE


def check_sliceable(architecture: str, n_layers: int, start: int, end: int) -> None:
    """Raise :class:`UnsupportedArchitectureError` for a model we have not verified."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture '{architecture}' is not supported for splitting; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if architecture == "gemma3" and (n_layers == _GEMMA3_27B_LAYERS or end - start == _GEMMA3_27B_LAYERS):
        if not (start == 0 and end == n_layers):
            raise UnsupportedArchitectureError(
                "architecture 'gemma3' with 62 layers (27B) is not supported for splitting: "
                "llama.cpp chooses its attention scale from the layer count"
            )


def gemma3_swa_layers(reader: GGUFReader, n_layers: int, path: Path) -> list[bool]:
    """Per-layer sliding-window flags of a gemma3 model, by GLOBAL layer index.

    Mirrors llama.cpp ``llama_model_base::load_swa_pattern(ml, 6)``: a bool/int array
    ``gemma3.attention.sliding_window_pattern`` is taken as is; a scalar is the period p
    (layer il is SWA iff p == 0 or il % p < p - 1); absent means p = 6.
    """
    key = "gemma3.attention.sliding_window_pattern"
    field = reader.get_field(key)
    if field is None:
        period = GEMMA3_DEFAULT_SWA_PERIOD
    elif field.types[0] == GGUFValueType.ARRAY:
        values = [bool(v) for v in field.contents()]
        if len(values) != n_layers:
            raise ModelFileError(
                f"{path}: '{key}' has {len(values)} entries, expected {n_layers} (one per block)"
            )
        return values
    else:
        period = int(field.contents())
    return [period == 0 or (il % period) < (period - 1) for il in range(n_layers)]


@dataclass(frozen=True, slots=True)
class _KV:
    key: str
    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


def _read_kvs(reader: GGUFReader, path: Path) -> list[_KV]:
    """Every metadata key of ``reader`` (in file order) except the GGUF.* pseudo-keys."""
    out: list[_KV] = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        main = field.types[0]
        if main == GGUFValueType.ARRAY:
            if len(field.types) != 2:
                raise ModelFileError(f"{path}: metadata key '{key}' is a nested array; not supported")
            out.append(_KV(key, field.contents(), main, field.types[1]))
        else:
            out.append(_KV(key, field.contents(), main))
    return out


def _slice_kvs(
    kvs: list[_KV], arch: str, n_layers: int, start: int, end: int, tiny_vocab: bool,
    swa_pattern: list[bool] | None,
) -> list[_KV]:
    out: list[_KV] = []
    block_count_key = f"{arch}.block_count"
    vocab_key = f"{arch}.vocab_size"
    swa_key = f"{arch}.attention.sliding_window_pattern"
    for kv in kvs:
        if kv.key == "general.architecture":
            continue  # GGUFWriter writes it itself
        if kv.key == block_count_key:
            out.append(_KV(kv.key, end - start, GGUFValueType.UINT32))
            continue
        if swa_pattern is not None and kv.key == swa_key:
            continue  # rewritten below from global indices
        if tiny_vocab and (kv.key.startswith("tokenizer.") or kv.key == vocab_key):
            continue
        if (
            kv.vtype == GGUFValueType.ARRAY
            and kv.key.startswith(f"{arch}.")
            and len(kv.value) == n_layers
        ):
            out.append(_KV(kv.key, kv.value[start:end], kv.vtype, kv.sub_type))
            continue
        out.append(kv)
    if swa_pattern is not None:
        out.append(_KV(swa_key, swa_pattern[start:end], GGUFValueType.ARRAY, GGUFValueType.BOOL))
    if tiny_vocab:
        out.append(_KV(vocab_key, TINY_VOCAB, GGUFValueType.UINT32))
        out.append(_KV("tokenizer.ggml.model", "none", GGUFValueType.STRING))
    return out


def _plan_tensors(
    reader: GGUFReader, start: int, end: int, keep_embedding: bool, keep_head: bool,
    n_embd: int,
) -> list[tuple[str, Any]]:
    """(new name, reader tensor or a numpy array) for each tensor of the slice, in order."""
    plan: list[tuple[str, Any]] = []
    keep_full_vocab = keep_embedding or keep_head
    for t in reader.tensors:
        i = block_index(t.name)
        if i is not None:
            if start <= i < end:
                rest = t.name[len(f"blk.{i}."):]
                plan.append((f"blk.{i - start}.{rest}", t))
            continue
        if t.name == "token_embd.weight":
            if keep_full_vocab:
                plan.append((t.name, t))
            else:
                # numpy shape (rows, cols) = ggml [n_embd, TINY_VOCAB]
                plan.append((t.name, np.zeros((TINY_VOCAB, n_embd), dtype=np.float32)))
            continue
        if t.name.startswith("output.") and not keep_head:
            continue  # the head: output.weight (and output.bias for qwen2-style models)
        plan.append((t.name, t))  # output_norm, rope_freqs, ...: needed by every stage
    return plan


def _add_raw_tensor(writer: GGUFWriter, name: str, src: Any) -> None:
    """Declare a tensor in the writer without loading its data.

    The reader exposes quantized tensors as uint8 arrays of *byte* shape (rows, row
    bytes) and float/int tensors with their element dtype and shape. GGUFWriter's
    ``add_tensor_info(..., raw_dtype=...)`` converts a uint8 byte shape back to the
    element shape (``quant_shape_from_byte_shape``) and keeps other shapes, so passing the
    reader's array shape and dtype with ``raw_dtype=tensor_type`` round-trips every type.
    """
    if isinstance(src, np.ndarray):
        writer.add_tensor_info(name, src.shape, src.dtype, src.nbytes)
        return
    data = src.data
    writer.add_tensor_info(
        name, data.shape, data.dtype, int(data.nbytes),
        raw_dtype=GGMLQuantizationType(src.tensor_type),
    )


def write_slice(
    src: Path | str,
    layer_start: int,
    layer_end: int,
    dest: Path | str,
    *,
    keep_embedding: bool,
    keep_head: bool,
    progress: ProgressFn | None = None,
) -> Path:
    """Write blocks [layer_start, layer_end) of the GGUF ``src`` to ``dest``; return ``dest``.

    ``keep_embedding`` / ``keep_head`` select the stage role (module docstring): with
    neither, the slice carries the tiny vocabulary. ``progress("slice", done, total)`` is
    called with tensor bytes written.

    Raises :class:`ModelFileError` (bad source), :class:`UnsupportedArchitectureError`,
    :class:`SliceRangeError`; an ``OSError`` from writing propagates. On any error no file
    is left at ``dest`` (an existing ``dest`` is left untouched).
    """
    src = Path(src)
    dest = Path(dest)
    reader = open_gguf(src)
    if reader.byte_order != "I":
        raise ModelFileError(f"{src}: byte-swapped (big-endian) GGUF files are not supported")
    arch = require_field(reader, "general.architecture", src, str)
    n_layers = require_field(reader, f"{arch}.block_count", src)
    n_embd = require_field(reader, f"{arch}.embedding_length", src)
    check_range(layer_start, layer_end, n_layers, f"{src.name}")
    check_sliceable(arch, n_layers, layer_start, layer_end)

    tiny_vocab = not (keep_embedding or keep_head)
    swa = gemma3_swa_layers(reader, n_layers, src) if arch == "gemma3" else None
    kvs = _slice_kvs(_read_kvs(reader, src), arch, n_layers, layer_start, layer_end, tiny_vocab, swa)
    plan = _plan_tensors(reader, layer_start, layer_end, keep_embedding, keep_head, n_embd)
    total = sum(int(s.nbytes) if isinstance(s, np.ndarray) else int(s.data.nbytes) for _, s in plan)

    with atomic_gguf_writer(dest, arch) as writer:
        alignment = field_value(reader, "general.alignment")
        if isinstance(alignment, int) and alignment > 0:
            writer.data_alignment = alignment
        for kv in kvs:
            if kv.vtype == GGUFValueType.ARRAY and len(kv.value) == 0:
                log.debug("%s: dropping empty array %s (GGUF writer cannot write it)", src, kv.key)
                continue
            writer.add_key_value(kv.key, kv.value, kv.vtype, kv.sub_type)
        for name, s in plan:
            _add_raw_tensor(writer, name, s)
        begin_tensor_data(writer)
        done = 0
        report(progress, "slice", 0, total)
        for _name, s in plan:
            data = s if isinstance(s, np.ndarray) else s.data
            # Streams from the source's memory map: one tensor in memory at a time.
            writer.write_tensor_data(data)
            done += int(data.nbytes)
            report(progress, "slice", done, total)
    return dest


# Slices of this process's loaded engines (path -> holders): never evicted. The cache
# is shared by the stage server and the coordinator's stage 0, each in its own thread.
_PINNED: dict[Path, int] = {}
_PIN_LOCK = threading.Lock()
DEFAULT_SLICE_QUOTA = 32 * 1024 ** 3


class SliceCache:
    """Slices built on demand and kept under ``paths.slices``.

    Keyed by (source sha256, start, end, role, slice format version); each slice
    ``<key>.gguf`` has a manifest ``<key>.json`` written after it. A slice is reused when
    its manifest matches and its size and mtime are the ones recorded.

    The cache holds at most ``quota`` bytes of slices (default
    :data:`DEFAULT_SLICE_QUOTA`): after a slice is built, the least recently used ones
    (the manifest's mtime is touched on every use) are deleted until the rest fit, except
    slices pinned by a loaded engine (:meth:`get` with ``pin=True``, then :func:`unpin`)
    and the slice just returned. A coordinator asks for slices by layer range, so
    without a quota a member could fill this node's disk with ranges.
    """

    def __init__(self, paths: "NodePaths", quota: int = DEFAULT_SLICE_QUOTA) -> None:
        self.root = paths.slices
        self.quota = quota

    def key(self, source_sha256: str, start: int, end: int, role: StageRole) -> str:
        return f"{source_sha256[:24]}-{start}-{end}-{role.value}-v{SLICE_FORMAT_VERSION}"

    def get(
        self, model: "ModelRef", start: int, end: int, *, progress: ProgressFn | None = None,
        pin: bool = False,
    ) -> Path:
        """Path of the slice [start, end) of ``model``, building it if needed.

        The whole range returns ``model.path`` itself. ``pin``: keep the slice from
        eviction until :func:`unpin` (an engine will load it). Raises as
        :func:`write_slice`.
        """
        role = stage_role_checked(model, start, end)
        if role is StageRole.WHOLE:
            return model.path
        key = self.key(model.sha256, start, end, role)
        path = self.root / f"{key}.gguf"
        manifest = self.root / f"{key}.json"
        if pin:
            _pin(path)
        try:
            if self._valid(path, manifest, model.sha256):
                with contextlib.suppress(OSError):
                    os.utime(manifest)   # most recently used
                return path
            self._build(model, start, end, role, path, manifest, progress)
        except BaseException:
            if pin:
                unpin(path)
            raise
        self.evict(keep=path)
        return path

    def evict(self, keep: Path | None = None) -> list[Path]:
        """Delete least recently used slices until the cache fits its quota (never a
        pinned slice, nor ``keep``); returns the slices deleted."""
        entries = []
        for g in self.root.glob("*.gguf"):
            m = g.with_suffix(".json")
            try:
                size = g.stat().st_size
                used = m.stat().st_mtime_ns if m.exists() else 0
            except OSError:
                continue
            entries.append((used, g, m, size))
        total = sum(e[3] for e in entries)
        gone: list[Path] = []
        with _PIN_LOCK:
            pinned = set(_PINNED)
        for used, g, m, size in sorted(entries, key=lambda e: e[0]):
            if total <= self.quota:
                break
            if g == keep or g in pinned:
                continue
            with contextlib.suppress(OSError):
                m.unlink(missing_ok=True)   # the manifest first: a half-deleted slice is invalid
                g.unlink(missing_ok=True)
                total -= size
                gone.append(g)
                log.info("slice cache over its quota (%d bytes): evicted %s", self.quota, g.name)
        return gone

    def _build(self, model: "ModelRef", start: int, end: int, role: StageRole, path: Path,
               manifest: Path, progress: ProgressFn | None) -> None:
        write_slice(
            model.path, start, end, path,
            keep_embedding=role.keep_embedding, keep_head=role.keep_head, progress=progress,
        )
        self._record(path, manifest, model.sha256, model.name, model.architecture, model.n_layers,
                     start, end, role)

    @staticmethod
    def _record(path: Path, manifest: Path, sha256: str, name: str, architecture: str, n_layers: int,
                start: int, end: int, role: StageRole) -> None:
        st = path.stat()
        from meshnode.fsutil import atomic_write

        record = {
            "source_sha256": sha256,
            "source_name": name,
            "architecture": architecture,
            "source_n_layers": n_layers,
            "start": start,
            "end": end,
            "role": role.value,
            "format": SLICE_FORMAT_VERSION,
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
        }
        with atomic_write(manifest, "w") as f:
            json.dump(record, f, indent=2)  # type: ignore[arg-type]

    # -- packages fetched from peers (a node that does not hold the model)

    def package_path(self, source_sha256: str, start: int, end: int, n_layers: int) -> Path:
        """Where the slice [start, end) of a model of ``n_layers`` layers lives in this cache."""
        role = stage_role(start, end, n_layers)
        return self.root / f"{self.key(source_sha256, start, end, role)}.gguf"

    def lookup(self, source_sha256: str, start: int, end: int, n_layers: int, *, pin: bool = False) -> Path | None:
        """The cached slice, built here or fetched (:meth:`adopt`), or None."""
        path = self.package_path(source_sha256, start, end, n_layers)
        if not self._valid(path, path.with_suffix(".json"), source_sha256):
            return None
        with contextlib.suppress(OSError):
            os.utime(path.with_suffix(".json"))
        if pin:
            _pin(path)
        return path

    def adopt(self, path: Path, source_sha256: str, name: str, start: int, end: int, n_layers: int) -> None:
        """Record the verified package at :meth:`package_path` (fetched from a peer), then
        keep the cache within its quota."""
        self._record(path, path.with_suffix(".json"), source_sha256, name, "", n_layers,
                     start, end, stage_role(start, end, n_layers))
        self.evict(keep=path)

    def list(self) -> list[dict[str, Any]]:
        """Manifests of the cached slices (unreadable ones skipped)."""
        out = []
        for m in sorted(self.root.glob("*.json")):
            if m.name.endswith(".part.json"):   # a fetch in progress (meshnode.models.transfer)
                continue
            with contextlib.suppress(OSError, ValueError):
                out.append(json.loads(m.read_text()))
        return out

    @staticmethod
    def _valid(path: Path, manifest: Path, sha256: str) -> bool:
        try:
            record = json.loads(manifest.read_text())
            st = path.stat()
        except (OSError, ValueError):
            return False
        return (
            isinstance(record, dict)
            and record.get("source_sha256") == sha256
            and record.get("format") == SLICE_FORMAT_VERSION
            and record.get("size") == st.st_size
            and record.get("mtime_ns") == st.st_mtime_ns
        )


def _pin(path: Path) -> None:
    with _PIN_LOCK:
        _PINNED[path] = _PINNED.get(path, 0) + 1


def unpin(path: Path | str | None) -> None:
    """The engine loaded from ``path`` (pinned by :meth:`SliceCache.get`) is closed."""
    if path is None:
        return
    path = Path(path)
    with _PIN_LOCK:
        n = _PINNED.get(path, 0) - 1
        if n > 0:
            _PINNED[path] = n
        else:
            _PINNED.pop(path, None)


def stage_role_checked(model: "ModelRef", start: int, end: int) -> StageRole:
    """:func:`stage_role` plus the architecture check, before any file is touched."""
    role = stage_role(start, end, model.n_layers)
    if role is not StageRole.WHOLE:  # a whole model is run as is, whatever its architecture
        check_sliceable(model.architecture, model.n_layers, start, end)
    return role
