"""Derive a draft model from a target: same tokenizer, less compute.

For the speculative benchmark we need a draft that shares the target's vocabulary
exactly. Two cheap ways to get one from the target file itself:

- :func:`requantize`: the same network at fewer bits per weight (llama.cpp's own
  quantizer, ``llama_model_quantize``; a quantized source needs ``allow_requantize``,
  so quality drops twice). Cheaper per token only where decode is memory-bound.
- :func:`truncate_layers`: the first ``n_keep`` blocks, then the target's own output
  norm and head (an "early exit"). Cost scales with ``n_keep / n_layer``; agreement with
  the target falls fast as layers go, since no layer was trained to feed the head.

Both write to a temp file beside ``dest`` and rename it into place, so a reader never sees
a half-written model. The tokenizer metadata is carried over untouched; check the result
with :func:`meshnode.spec.draft.check_vocab` anyway.

Note: :func:`requantize` imports ``llama_cpp`` and ``meshnode.engine.llama_log`` lazily:
it is the one llama_cpp user outside ``meshnode.engine`` (it runs no model, only the
offline quantizer), and importing this module stays free of llama_cpp.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from meshnode.models.errors import ModelFileError
from meshnode.models.gguf_info import open_gguf
from meshnode.models.progress import ProgressFn
from meshnode.models.slicer import write_slice

__all__ = ["QUANT_TYPES", "requantize", "truncate_layers"]

# Names accepted by requantize (llama_ftype LLAMA_FTYPE_MOSTLY_<name>).
QUANT_TYPES: tuple[str, ...] = (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L",
    "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "F16", "BF16",
)


def _ftype(name: str | int) -> int:
    import llama_cpp

    if isinstance(name, int) and not isinstance(name, bool):
        return name
    key = str(name).upper()
    if key not in QUANT_TYPES:
        raise ValueError(f"unknown quantization type {name!r}; choose one of {', '.join(QUANT_TYPES)}")
    return int(getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{key}"))


def requantize(
    src: Path | str,
    dest: Path | str,
    ftype: str | int = "Q4_0",
    *,
    n_threads: int = 1,
    allow_requantize: bool = True,
) -> Path:
    """Quantize the GGUF ``src`` to ``ftype`` (a name of :data:`QUANT_TYPES` or a
    llama_ftype value) at ``dest``; return ``dest``.

    Tensors whose shape a k-quant cannot take (rows not a multiple of 256, e.g.
    SmolLM2's 576) fall back to a compatible type chosen by llama.cpp.
    Raises ``ValueError`` for an unknown type, :class:`ModelFileError` when the source is
    not a readable GGUF or llama.cpp's quantizer fails. Nothing is left at ``dest`` on
    failure (an existing ``dest`` stays untouched).
    """
    import llama_cpp

    from meshnode.engine.llama_log import install_log_bridge

    install_log_bridge()  # the quantizer logs a line per tensor; route it to debug logging
    src, dest = Path(src), Path(dest)
    open_gguf(src)  # a clear ModelFileError for a missing / non-GGUF / truncated file
    ftype_value = _ftype(ftype)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype_value
    params.nthread = max(1, int(n_threads))
    params.allow_requantize = allow_requantize
    with _temp_beside(dest) as tmp:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise ModelFileError(f"llama.cpp could not quantize {src.name} to {ftype} (code {rc})")
        os.replace(tmp, dest)
    return dest


def truncate_layers(
    src: Path | str,
    dest: Path | str,
    n_keep: int,
    *,
    progress: ProgressFn | None = None,
) -> Path:
    """Write the first ``n_keep`` blocks of ``src`` plus its output norm, head and tokenizer
    to ``dest`` (a whole model of ``n_keep`` layers); return ``dest``.

    Raises :class:`~meshnode.models.errors.SliceRangeError` unless
    ``1 <= n_keep <= n_layer``, :class:`ModelFileError` /
    :class:`~meshnode.models.errors.UnsupportedArchitectureError` as
    :func:`meshnode.models.slicer.write_slice`.
    """
    # blocks [0, n_keep) with both ends of the model kept: write_slice keeps token_embd,
    # the tokenizer, output_norm and output.weight (when the model has one) for this role
    return write_slice(src, 0, n_keep, dest, keep_embedding=True, keep_head=True, progress=progress)


@contextlib.contextmanager
def _temp_beside(dest: Path):
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    os.close(fd)
    tmp = Path(name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a model file is an ordinary file
    try:
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
