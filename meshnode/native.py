"""Small C helpers compiled on first use with the system C compiler (optional).

Some hot paths are worth a few lines of C that Python cannot match: the capture
callback of a non-final stage (``engine/_tap.c``) and the busy-poll wait of the event
loop (``net/_spin.c``). Each file is compiled once per machine with ``cc`` into the user
cache, named by its hash (an edited file gets a new library), and loaded with ctypes,
which releases the GIL around every call. Where no compiler is found, the build fails,
or ``MESHNODE_NO_NATIVE=1``, :func:`load_c_library` returns None and the caller falls
back to pure Python.
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


@cache
def load_c_library(source: Path, what: str) -> ctypes.CDLL | None:
    """``source`` compiled (once per machine) and loaded, or None (module docstring);
    ``what`` names it in the log line that says why not."""
    if os.environ.get("MESHNODE_NO_NATIVE"):
        return None
    code = source.read_bytes()
    out_dir = Path(platformdirs.user_cache_dir("meshnode")) / "native"
    lib_path = out_dir / f"libmeshnode{source.stem}-{hashlib.sha256(code).hexdigest()[:12]}.so"
    if not lib_path.exists():
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            log.info("no C compiler: %s runs without its native helper", what)
            return None
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
        os.close(fd)
        try:
            subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(source)],
                           check=True, capture_output=True, timeout=120)
            os.replace(tmp, lib_path)
        except (OSError, subprocess.SubprocessError) as exc:
            log.info("cannot build the native helper of %s (%s): using Python", what, exc)
            Path(tmp).unlink(missing_ok=True)
            return None
    return ctypes.CDLL(str(lib_path))
