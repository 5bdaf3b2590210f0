"""Typed errors of the models package.

All are :class:`~meshnode.errors.MeshnodeError` subclasses: the message names the file or
field at fault and is meant for the user. Callers match on the type, never on the text.
"""

from __future__ import annotations

from meshnode.errors import MeshnodeError


class ModelFileError(MeshnodeError):
    """A model file is missing, is not GGUF, is truncated or lacks a needed key."""


class UnsupportedArchitectureError(ModelFileError):
    """The model's architecture is not on the slicer's verified list."""


class SliceRangeError(MeshnodeError):
    """A layer range is empty or outside the model's blocks."""


class ModelNotFoundError(MeshnodeError):
    """A model name is neither a file nor a model in the store."""


class ModelFetchError(MeshnodeError):
    """Downloading or unpacking a model failed (network, pip, archive member missing)."""


class ChecksumError(ModelFetchError):
    """A downloaded or local file does not have the expected sha256 / size."""


class ModelPackageError(MeshnodeError):
    """A ``model-package.json`` is unreadable or has a bad field (the message names it)."""
