"""User-facing error base.

Anything raised as a :class:`MeshnodeError` is the user's (or the environment's) problem
and is printed by the CLI as one clear line, never as a traceback. Modules define their
own typed subclasses (``ModelLoadError``, ``WireError`` ...); callers match on type, never
on message text.
"""


class MeshnodeError(Exception):
    """An error whose message is meant for the user."""

    exit_code = 2
