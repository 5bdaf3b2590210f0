"""Requantize a GGUF with llama.cpp's own quantizer (``meshnode models quantize``, and the
same-vocabulary drafts and targets the benchmarks derive).

The result is written to a temp file beside ``dest`` and renamed into place: a failed or
interrupted run leaves nothing at ``dest``. Progress comes from the quantizer's own log:
it writes ``[ i/ n] tensor ...`` before each tensor, which the log bridge turns into
Python log records that a temporary handler counts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import llama_cpp

from meshnode.fsutil import mkstemp_beside
from meshnode.gguf_files import model_size

from .errors import ModelLoadError
from .llama_log import LLAMA_LOGGER, install_log_bridge

# Called with (tensors done, tensors in all) as the quantizer works through the file.
TensorProgress = Callable[[int, int], None]
# The model store's progress hook: (phase, done, total) (meshnode.models.progress)
PhaseProgress = Callable[[str, int, "int | None"], None]
_TENSOR_LINE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")

# Names accepted by requantize (llama_ftype LLAMA_FTYPE_MOSTLY_<name>).
QUANT_TYPES: tuple[str, ...] = (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L",
    "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "F16", "BF16",
)


def quant_type_name(name: str) -> str:
    """``name`` as a :data:`QUANT_TYPES` entry (any case); ValueError naming the choices."""
    if name.upper() not in QUANT_TYPES:
        raise ValueError(f"unknown quantization type {name!r}; choose one of {', '.join(QUANT_TYPES)}")
    return name.upper()


def ftype_value(name: str | int) -> int:
    """llama_ftype for a name of :data:`QUANT_TYPES` (or an int passed through)."""
    if isinstance(name, int) and not isinstance(name, bool):
        return name
    return int(getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant_type_name(str(name))}"))


def requantize(src: Path | str, dest: Path | str, ftype: str | int = "Q4_0", *,
               n_threads: int = 1, allow_requantize: bool = True,
               progress: TensorProgress | None = None) -> Path:
    """Quantize the GGUF ``src`` to ``ftype`` at ``dest``; return ``dest``.

    Tensors whose shape a k-quant cannot take (rows not a multiple of 256, e.g. SmolLM2's
    576) fall back to a compatible type chosen by llama.cpp. Raises ``ValueError`` for an
    unknown type and :class:`ModelLoadError` when ``src`` is not a readable GGUF or the
    quantizer fails. ``progress(done, total)`` is told each tensor the quantizer starts
    (the last tensor's call comes before its work, so a caller finishes the bar itself).
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
    fd, tmp = mkstemp_beside(dest)
    os.close(fd)
    try:
        with _counting_tensors(progress):
            rc = llama_cpp.llama_model_quantize(str(src).encode(), tmp.encode(), params)
        if rc != 0:
            raise ModelLoadError(f"llama.cpp could not quantize {src.name} to {ftype} (code {rc})")
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return dest


def quantize_model(src: Path, dest: Path, ftype: str, progress: PhaseProgress, *,
                   n_threads: int | None = None, drawing: Callable[[], bool] = lambda: True) -> None:
    """:func:`requantize` (every core unless ``n_threads``) with its progress in bytes of
    ``src`` as the store's phase "quantize": `models quantize`, and the store's quantizer
    for derived models (meshnode.quantizer hands it in). ``drawing()`` false stops
    the progress calls (a cancelled command's closed bar)."""
    size = model_size(src)

    def tensor_done(done: int, total: int) -> None:
        if drawing():
            progress("quantize", size * done // max(total, 1), size)

    requantize(src, dest, ftype, n_threads=n_threads or os.cpu_count() or 1, progress=tensor_done)
    progress("quantize", size, size)


class _TensorCounter(logging.Handler):
    def __init__(self, progress: TensorProgress) -> None:
        super().__init__(logging.DEBUG)
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        m = _TENSOR_LINE.match(record.getMessage())
        if m:
            self.progress(int(m.group(1)) - 1, int(m.group(2)))


@contextlib.contextmanager
def _counting_tensors(progress: TensorProgress | None) -> Iterator[None]:
    """While quantizing, count the quantizer's per-tensor log lines into ``progress``.

    The bridge only forwards llama.cpp's lines while its logger is enabled for debug, so
    it is turned on for the call; unless the user asked for debug logs, the lines stop
    at our handler (a few per tensor: nobody wants them on the console)."""
    if progress is None:
        yield
        return
    log = logging.getLogger(LLAMA_LOGGER)
    handler = _TensorCounter(progress)
    level, propagate = log.level, log.propagate
    if not log.isEnabledFor(logging.DEBUG):
        log.setLevel(logging.DEBUG)
        log.propagate = False
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
