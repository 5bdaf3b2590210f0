"""The llama.cpp stage engine: the only package that imports llama_cpp.

See :mod:`meshnode.engine.stage` for the theory of operation.
"""

from .errors import (
    ContextOverflowError,
    DecodeError,
    EngineBusyError,
    EngineError,
    EngineInputError,
    ModelLoadError,
)
from .stage import KV_TYPES, EngineConfig, Segment, StageEngine

__all__ = [
    "KV_TYPES", "ContextOverflowError", "DecodeError", "EngineBusyError",
    "EngineError", "EngineInputError", "EngineConfig", "ModelLoadError", "Segment", "StageEngine",
]
