"""Route llama.cpp's own log lines into Python logging (debug level), once per process.

llama.cpp prints hundreds of lines per model load to stderr; users and the TUI should not
see them unless they ask for debug logs. When debug is off the callback returns at once.
"""

from __future__ import annotations

import ctypes
import logging

import llama_cpp

LLAMA_LOGGER = "meshnode.llama_cpp"
_log = logging.getLogger(LLAMA_LOGGER)
_installed = False


@llama_cpp.llama_log_callback
def _bridge(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    if _log.isEnabledFor(logging.DEBUG):
        msg = text.decode("utf-8", "replace").rstrip()
        if msg:
            _log.debug("%s", msg)


def install_log_bridge() -> None:
    global _installed
    if not _installed:
        llama_cpp.llama_log_set(_bridge, ctypes.c_void_p(0))
        _installed = True
