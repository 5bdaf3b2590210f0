"""Small random-weight GGUF models for tests (re-exported from meshnode.models.synthetic,
which benchmarks use too)."""

from meshnode.models.synthetic import (  # noqa: F401
    LAYOUTS,
    LLAMA_1B,
    SyntheticSpec,
    synthetic_vocab,
    write_synthetic_gguf,
)
