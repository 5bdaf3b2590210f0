"""The C version of the capture callback, compiled on first use (optional).

``native_tap(lib, target, buf)`` returns a ctypes callback + state that copy the tensor
``target`` into ``buf`` and stop the graph, like :class:`~meshnode.engine.ggml.LayerTap`
with one stop layer, but without entering Python per graph node. The C file is compiled
once per machine (:mod:`meshnode.native`); where it cannot be, callers fall back to the
Python callback: same results, a little slower.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from meshnode.native import load_c_library

SOURCE = Path(__file__).with_name("_tap.c")


class TapState(ctypes.Structure):
    _fields_ = [
        ("target", ctypes.c_char * 64),
        ("get_name", ctypes.c_void_p),
        ("nbytes", ctypes.c_void_p),
        ("tensor_get", ctypes.c_void_p),
        ("buf", ctypes.c_void_p),
        ("cap", ctypes.c_size_t),
        ("written", ctypes.c_size_t),
    ]


def _library() -> ctypes.CDLL | None:
    lib = load_c_library(SOURCE, "the capture callback")
    if lib is not None:
        lib.meshnode_tap_cb.restype = ctypes.c_bool
        lib.meshnode_tap_cb.argtypes = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p]
    return lib


def native_tap(ggml: ctypes.CDLL, target: str, buf_ptr: int, cap: int):
    """``(callback_pointer, state)`` for llama's ``cb_eval`` / ``cb_eval_user_data``,
    or None when the native library is unavailable. Keep ``state`` alive."""
    lib = _library()
    if lib is None:
        return None
    state = TapState()
    state.target = target.encode()
    state.get_name = ctypes.cast(ggml.ggml_get_name, ctypes.c_void_p).value
    state.nbytes = ctypes.cast(ggml.ggml_nbytes, ctypes.c_void_p).value
    state.tensor_get = ctypes.cast(ggml.ggml_backend_tensor_get, ctypes.c_void_p).value
    state.buf = buf_ptr
    state.cap = cap
    state.written = 0
    return ctypes.cast(lib.meshnode_tap_cb, ctypes.c_void_p).value, state
