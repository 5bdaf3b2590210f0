"""Typed engine failures. The serving layer maps these to OpenAI errors by type."""

from meshnode.errors import MeshnodeError


class EngineError(MeshnodeError):
    """Base class of every engine failure."""


class ModelLoadError(EngineError):
    """llama.cpp refused the file (not a model, truncated, unsupported, out of memory)."""


class EngineInputError(EngineError):
    """A caller passed rows of the wrong kind, width, dtype or position."""


class ContextOverflowError(EngineError):
    """A session would grow past its context size."""

    def __init__(self, needed: int, n_ctx: int) -> None:
        super().__init__(f"context overflow: {needed} positions needed, context holds {n_ctx}")
        self.needed = needed
        self.n_ctx = n_ctx


class EngineBusyError(EngineError):
    """Every sequence slot (or every KV cell) is in use."""


class DecodeError(EngineError):
    """llama_decode failed for a reason that is not the caller's."""
