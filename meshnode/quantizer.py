"""llama.cpp's quantizer for the model store.

The store makes some known models itself (the default model is the wheel's Q4_1
requantized to Q8_0: meshnode.models.catalog), but it sits beside the engine, not above
it, and may not import llama.cpp. Each process that can fetch models (the command line,
a :class:`~meshnode.node.Node`) calls :func:`hand_in_quantizer` once; it imports nothing
heavy (llama_cpp loads only when something is quantized).
"""

from __future__ import annotations

from pathlib import Path

from meshnode.models.quantizer_hook import set_quantizer
from meshnode.models.progress import ProgressFn

__all__ = ["hand_in_quantizer"]


def hand_in_quantizer() -> None:
    set_quantizer(_quantize)


def _quantize(src: Path, dest: Path, ftype: str, progress: ProgressFn) -> None:
    from meshnode.engine.quantize import quantize_model

    quantize_model(src, dest, ftype, progress)
