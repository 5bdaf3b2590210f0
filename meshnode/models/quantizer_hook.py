"""The quantizer the store makes derived models with (the default model is one).

llama.cpp's quantizer lives in the engine, a layer the model store must not import: the
process hands it in once (:mod:`meshnode.quantizer`, from the command line and every
Node). Kept in a module of its own, light to import, so that handing it in costs a
command nothing (the fetch code pulls in numpy, whose thread pool would start before
``--cpus`` pins the process).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from meshnode.models.progress import ProgressFn

__all__ = ["Quantizer", "quantizer", "set_quantizer"]

# quantizer(src, dest, llama.cpp type name, progress): writes dest atomically or raises
Quantizer = Callable[[Path, Path, str, ProgressFn], None]
_quantizer: Quantizer | None = None


def set_quantizer(q: Quantizer | None) -> None:
    """Hand in llama.cpp's quantizer, which making a DerivedSource needs."""
    global _quantizer
    _quantizer = q


def quantizer() -> Quantizer:
    """The quantizer handed in; RuntimeError if none was (a caller's bug, not the user's)."""
    if _quantizer is None:
        raise RuntimeError("making a derived model needs llama.cpp's quantizer: "
                           "call meshnode.quantizer.hand_in_quantizer() first")
    return _quantizer
