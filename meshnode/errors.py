"""User-facing error base.

Anything raised as a :class:`MeshnodeError` is the user's (or the environment's) problem
and is printed by the CLI as one clear line, never as a traceback. Modules define their
own typed subclasses (``ModelLoadError``, ``WireError`` ...); callers match on type, never
on message text.
"""

import errno
import os


class MeshnodeError(Exception):
    """An error whose message is meant for the user."""

    exit_code = 2


def cannot_listen(what: str, exc: OSError, option: str) -> MeshnodeError:
    """The error for an address a node cannot listen on: ``what`` says which (``serve HTTP
    on 127.0.0.1:8080``); where another program holds it, a hint names ``option``."""
    why = os.strerror(exc.errno) if exc.errno else str(exc)
    hint = (f" (another program uses it: another meshnode? `meshnode status`, or choose {option})"
            if exc.errno == errno.EADDRINUSE else "")
    return MeshnodeError(f"cannot {what}: {why}{hint}")
