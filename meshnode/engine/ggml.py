"""Just enough of ggml, through ctypes, to read one named tensor during a decode.

Theory of operation: llama.cpp calls the context's ``cb_eval`` callback twice per graph
node. With ``ask=True`` it asks "do you want this tensor's data?"; we say yes only for
the tensor named ``l_out-{il}`` (the residual stream after layer ``il``). With
``ask=False`` the tensor has been computed; we copy it out with
``ggml_backend_tensor_get`` and return False when it is the slice's last layer, which
stops the rest of the graph (output norm and lm_head never run).

The llama-cpp-python wheel ships several copies of libggml-base (``.so``, ``.so.0``,
``.so.0.x.y``); symbols must come from the very file libllama mapped, or we would talk
to a second ggml with its own globals. We find it in /proc/self/maps.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

import llama_cpp


def ggml_lib(mapped: str, glob: str) -> ctypes.CDLL:
    """The ggml library file that libllama mapped whose name contains ``mapped`` (else
    the first ``glob*`` beside libllama). Raises OSError when there is none."""
    candidates: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if mapped in os.path.basename(path) and path not in candidates:
                    candidates.append(path)
    except OSError:
        pass
    if not candidates:  # macOS / no procfs: the copy beside libllama
        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        candidates = sorted(str(p) for p in lib_dir.glob(glob + "*"))
    if not candidates:
        raise OSError(f"cannot find {glob} next to llama.cpp")
    return ctypes.CDLL(candidates[0])


@cache
def _libggml_base() -> ctypes.CDLL:
    lib = ggml_lib("libggml-base", "libggml-base")
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_backend_tensor_get.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
    ]
    lib.ggml_backend_tensor_get.restype = None
    return lib


class LayerTap:
    """The ``cb_eval`` callback of one context: copies ``l_out-{il}`` for chosen layers.

    ``stop_layer``: after copying this layer, stop the graph (non-final stages).
    ``taps``: other layers to copy without stopping (certification, debugging).
    ``buffers[il]`` is a float32 array of ``(rows, n_embd)`` owned here; :meth:`written`
    says how many bytes the last decode put in it. With only a stop layer (the hot path)
    the callback is native C when it can be built (:mod:`meshnode.engine.native`): the
    same copy without entering Python for every graph node.
    """

    def __init__(self, n_embd: int, rows: int, stop_layer: int | None, taps: tuple[int, ...] = ()) -> None:
        import numpy as np

        self._lib = _libggml_base()
        self.n_embd = n_embd
        self.stop_layer = stop_layer
        layers = set(taps) | ({stop_layer} if stop_layer is not None else set())
        self._names = {f"l_out-{il}".encode(): il for il in layers}
        self.buffers = {il: np.empty((rows, n_embd), dtype=np.float32) for il in layers}
        self.bytes_written: dict[int, int] = {il: 0 for il in layers}
        self._native = None
        if not taps and stop_layer is not None:
            from .native import native_tap

            buf = self.buffers[stop_layer]
            self._native = native_tap(self._lib, f"l_out-{stop_layer}", buf.ctypes.data, buf.nbytes)
        if self._native is not None:
            ptr, state = self._native
            self.c_callback = ctypes.cast(ptr, llama_cpp.ggml_backend_sched_eval_callback)
            self.user_data = ctypes.c_void_p(ctypes.addressof(state))
        else:
            # Keep a reference: ctypes callbacks die with their Python object.
            self.c_callback = llama_cpp.ggml_backend_sched_eval_callback(self._callback)
            self.user_data = None

    @property
    def native(self) -> bool:
        return self._native is not None

    def reset(self) -> None:
        if self._native is not None:
            self._native[1].written = 0
        for il in self.bytes_written:
            self.bytes_written[il] = 0

    def written(self, il: int) -> int:
        if self._native is not None:
            return int(self._native[1].written)
        return self.bytes_written[il]

    def _callback(self, tensor: int, ask: bool, _user_data: int) -> bool:
        lib = self._lib
        il = self._names.get(lib.ggml_get_name(tensor))
        if ask:
            return il is not None
        if il is None:
            return True
        buf = self.buffers[il]
        nbytes = lib.ggml_nbytes(tensor)
        offset = self.bytes_written[il]
        if offset + nbytes > buf.nbytes:
            return False  # never write past our buffer; the owner sees a short capture
        lib.ggml_backend_tensor_get(tensor, buf.ctypes.data + offset, 0, nbytes)
        self.bytes_written[il] = offset + nbytes
        # Returning False stops the scheduler: nothing after the slice's last layer runs.
        return il != self.stop_layer
