"""The C version of the capture callback, compiled on first use (optional).

``native_tap(lib, target, buf)`` returns a ctypes callback + state that copy the tensor
``target`` into ``buf`` and stop the graph, like :class:`~meshnode.engine.ggml.LayerTap`
with one stop layer, but without entering Python per graph node. The C file is compiled
once per machine with ``cc`` into the user cache; where no compiler is found (or
``MESHNODE_NO_NATIVE=1``) callers fall back to the Python callback: same results, a
little slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import platformdirs

log = logging.getLogger(__name__)

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


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("MESHNODE_NO_NATIVE"):
        return None
    code = SOURCE.read_bytes()
    out_dir = Path(platformdirs.user_cache_dir("meshnode")) / "native"
    lib_path = out_dir / f"libmeshnode_tap-{hashlib.sha256(code).hexdigest()[:12]}.so"
    if not lib_path.exists():
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            log.info("no C compiler: using the Python capture callback")
            return None
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
        os.close(fd)
        try:
            subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE)],
                           check=True, capture_output=True, timeout=120)
            os.replace(tmp, lib_path)
        except (OSError, subprocess.SubprocessError) as exc:
            log.info("cannot build the native capture callback (%s): using Python", exc)
            Path(tmp).unlink(missing_ok=True)
            return None
    lib = ctypes.CDLL(str(lib_path))
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
