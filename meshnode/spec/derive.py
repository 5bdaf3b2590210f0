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

Requantization runs llama.cpp's quantizer, so it lives in the engine
(:func:`meshnode.engine.quantize.requantize`, wrapped here and imported only when called,
so importing this module loads no llama_cpp). Deriving a draft composes the model slicer
with the engine's quantizer, which is speculation's business rather than the model
store's: the ``models`` package does not depend on the engine.
"""

from __future__ import annotations

from pathlib import Path

from meshnode.models.progress import ProgressFn
from meshnode.models.slicer import write_slice


def requantize(src: Path | str, dest: Path | str, ftype: str | int = "Q4_0", **kw) -> Path:
    """See :func:`meshnode.engine.quantize.requantize` (imported lazily: llama_cpp)."""
    from meshnode.engine.quantize import requantize as _requantize

    return _requantize(src, dest, ftype, **kw)


__all__ = ["requantize", "truncate_layers"]

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
