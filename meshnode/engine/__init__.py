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
from .stage import EngineConfig, Segment, StageEngine

__all__ = [
    "ContextOverflowError", "DecodeError", "EngineBusyError",
    "EngineError", "EngineInputError", "EngineConfig", "ModelLoadError", "Segment", "StageEngine",
]
