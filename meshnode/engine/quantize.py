"""Requantize a GGUF with llama.cpp's own quantizer (used to derive same-vocabulary drafts).

The result is written to a temp file beside ``dest`` and renamed into place: a failed or
interrupted run leaves nothing at ``dest``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import llama_cpp

from .errors import ModelLoadError
from .llama_log import install_log_bridge

# Names accepted by requantize (llama_ftype LLAMA_FTYPE_MOSTLY_<name>).
QUANT_TYPES: tuple[str, ...] = (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L",
    "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "F16", "BF16",
)


def ftype_value(name: str | int) -> int:
    """llama_ftype for a name of :data:`QUANT_TYPES` (or an int passed through)."""
    if isinstance(name, int) and not isinstance(name, bool):
        return name
    key = str(name).upper()
    if key not in QUANT_TYPES:
        raise ValueError(f"unknown quantization type {name!r}; choose one of {', '.join(QUANT_TYPES)}")
    return int(getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{key}"))


def requantize(src: Path | str, dest: Path | str, ftype: str | int = "Q4_0", *,
               n_threads: int = 1, allow_requantize: bool = True) -> Path:
    """Quantize the GGUF ``src`` to ``ftype`` at ``dest``; return ``dest``.

    Tensors whose shape a k-quant cannot take (rows not a multiple of 256, e.g. SmolLM2's
    576) fall back to a compatible type chosen by llama.cpp. Raises ``ValueError`` for an
    unknown type and :class:`ModelLoadError` when ``src`` is not a readable GGUF or the
    quantizer fails.
    """
    install_log_bridge()  # the quantizer logs a line per tensor; route it to debug logging
    src, dest = Path(src), Path(dest)
    try:
        with open(src, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {src}: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"{src} is not a GGUF file")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype_value(ftype)
    params.nthread = max(1, int(n_threads))
    params.allow_requantize = allow_requantize
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    os.close(fd)
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), tmp.encode(), params)
        if rc != 0:
            raise ModelLoadError(f"llama.cpp could not quantize {src.name} to {ftype} (code {rc})")
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return dest
