"""Random-weight GGUF models with real shapes, for tests and benchmarks.

Outputs of these models are noise; their shapes, metadata and tokenizer are real enough
for llama.cpp to load and run them, so they cover architectures we have no small real
model for (qwen2 with attention biases, qwen3 with q/k norms, gemma3 with sliding-window
layers and post-norms) and give honest timings for larger shapes (:data:`LLAMA_1B`).

Tensors are generated and written one at a time (see :mod:`meshnode.models.gguf_write`),
so a ~1B-parameter model never sits in memory whole. The tokenizer is a small
SentencePiece-style ("llama") vocabulary: <unk>, <s>, </s>, the 256 byte-fallback tokens,
then single characters and a few "▁word" pieces, which llama.cpp tokenizes any text with.

Any architecture name may be written (``SyntheticSpec(architecture="mamba")`` gives a
llama-shaped file that claims to be mamba, for refusal tests); the tensor layout follows
``layout`` (default: the architecture when it is one of llama/qwen2/qwen3/gemma3, else
llama).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from meshnode.models.gguf_write import atomic_gguf_writer, begin_tensor_data
from meshnode.models.progress import ProgressFn, report

LAYOUTS = ("llama", "qwen2", "qwen3", "gemma3")
MIN_VOCAB = 262  # 3 specials + 256 bytes + a few pieces

# llama_ftype values (gguf.LlamaFileType): ALL_F32 = 0, MOSTLY_F16 = 1.
_FILE_TYPE = {"f32": 0, "f16": 1}
_NP_DTYPE = {"f32": np.float32, "f16": np.float16}

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

__all__ = [
    "LAYOUTS",
    "LLAMA_1B",
    "SyntheticSpec",
    "synthetic_vocab",
    "write_synthetic_gguf",
]


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """Shape of a synthetic model. ``dtype`` applies to matrices; norms/biases are f32."""

    architecture: str = "llama"
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_kv_head: int = 2
    n_ff: int = 128
    vocab: int = 320
    dtype: str = "f32"                 # "f32" or "f16"
    seed: int = 0
    head_dim: int | None = None        # default n_embd // n_head
    tied_embeddings: bool = False      # no output.weight: the head reuses token_embd
    context_length: int = 4096
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-6
    sliding_window: int = 16           # gemma3 only
    swa_pattern: int | Sequence[bool] | None = None  # gemma3: None = llama.cpp's default (6)
    per_layer_head_count_kv: bool = False  # write head_count_kv as a per-layer array
    # extra metadata (key, value, GGUFValueType, array sub-type or None), written last
    extra_metadata: tuple[tuple[str, Any, GGUFValueType, GGUFValueType | None], ...] = ()
    layout: str | None = None          # tensor layout; default from architecture
    name: str | None = None
    weight_scale: float = 0.02

    @property
    def tensor_layout(self) -> str:
        if self.layout is not None:
            return self.layout
        return self.architecture if self.architecture in LAYOUTS else "llama"

    @property
    def n_embd_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    def validate(self) -> None:
        if self.dtype not in _FILE_TYPE:
            raise ValueError(f"dtype must be 'f32' or 'f16', got {self.dtype!r}")
        if self.tensor_layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.tensor_layout!r}")
        if self.vocab < MIN_VOCAB:
            raise ValueError(f"vocab must be at least {MIN_VOCAB} (byte-fallback tokenizer)")
        if self.head_dim is None and self.n_embd % self.n_head:
            raise ValueError("n_embd must be a multiple of n_head (or give head_dim)")
        if self.n_head % self.n_kv_head:
            raise ValueError("n_head must be a multiple of n_kv_head")
        if self.n_layer < 1:
            raise ValueError("n_layer must be >= 1")

    def n_params(self) -> int:
        """Parameter count, the way llama.cpp counts it (tied head counted once)."""
        return sum(int(np.prod(shape)) for _, shape, _ in _tensor_plan(self))


LLAMA_1B = SyntheticSpec(
    architecture="llama", n_layer=16, n_embd=2048, n_head=32, n_kv_head=8, n_ff=8192,
    vocab=32000, dtype="f16", rope_freq_base=500000.0, rms_eps=1e-5, name="synthetic-llama-1b",
)


def synthetic_vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    """tokens, scores, token types of an ``n``-token SPM vocabulary (n >= MIN_VOCAB)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # UNKNOWN, CONTROL, CONTROL, BYTE...
    seen = set(tokens)
    pieces: list[str] = []
    alphabet = "etaoinshrdlcumwfgypbvkjxqz"
    candidates = (
        ["▁"]
        + list(alphabet)
        + [f"▁{c}" for c in alphabet]
        + list(alphabet.upper())
        + list("0123456789.,:;!?'\"()[]{}<>-_=+*/\\|@#$%^&~`")
        + [f"▁{w}" for w in ("the", "of", "and", "to", "in", "is", "it", "you", "that", "he")]
        + [a + b for a in alphabet for b in alphabet]
        + [f"▁{a}{b}" for a in alphabet for b in alphabet]
    )
    for c in candidates:
        if len(tokens) + len(pieces) >= n:
            break
        if c not in seen:
            seen.add(c)
            pieces.append(c)
    i = 0
    while len(tokens) + len(pieces) < n:  # very large vocabularies: filler pieces
        c = f"▁tok{i}"
        i += 1
        if c not in seen:
            seen.add(c)
            pieces.append(c)
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    return tokens + pieces, scores, types + [1] * len(pieces)


# (name, numpy shape (outermost first; ggml ne reversed), kind) ; kind: "w" matrix, "n" norm, "b" bias
def _tensor_plan(spec: SyntheticSpec) -> list[tuple[str, tuple[int, ...], str]]:
    e, hd, v, ff = spec.n_embd, spec.n_embd_head, spec.vocab, spec.n_ff
    q, kv = spec.n_head * hd, spec.n_kv_head * hd
    layout = spec.tensor_layout
    plan: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (v, e), "w")]
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (e,), "n"),
            (b + "attn_q.weight", (q, e), "w"),
            (b + "attn_k.weight", (kv, e), "w"),
            (b + "attn_v.weight", (kv, e), "w"),
        ]
        if layout == "qwen2":
            plan += [(b + "attn_q.bias", (q,), "b"), (b + "attn_k.bias", (kv,), "b"),
                     (b + "attn_v.bias", (kv,), "b")]
        if layout in ("qwen3", "gemma3"):
            plan += [(b + "attn_q_norm.weight", (hd,), "n"), (b + "attn_k_norm.weight", (hd,), "n")]
        plan.append((b + "attn_output.weight", (e, q), "w"))
        if layout == "gemma3":
            plan.append((b + "post_attention_norm.weight", (e,), "n"))
        plan += [
            (b + "ffn_norm.weight", (e,), "n"),
            (b + "ffn_gate.weight", (ff, e), "w"),
            (b + "ffn_up.weight", (ff, e), "w"),
            (b + "ffn_down.weight", (e, ff), "w"),
        ]
        if layout == "gemma3":
            plan.append((b + "post_ffw_norm.weight", (e,), "n"))
    plan.append(("output_norm.weight", (e,), "n"))
    if not spec.tied_embeddings:
        plan.append(("output.weight", (v, e), "w"))
    return plan


def _metadata(spec: SyntheticSpec) -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    a = spec.architecture
    U32, F32, STR, ARR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.ARRAY
    tokens, scores, types = synthetic_vocab(spec.vocab)
    kv: list[tuple[str, Any, GGUFValueType, GGUFValueType | None]] = [
        ("general.type", "model", STR, None),
        ("general.name", spec.name or f"synthetic-{a}-{spec.n_layer}L-{spec.n_embd}", STR, None),
        ("general.file_type", _FILE_TYPE[spec.dtype], U32, None),
        (f"{a}.context_length", spec.context_length, U32, None),
        (f"{a}.embedding_length", spec.n_embd, U32, None),
        (f"{a}.block_count", spec.n_layer, U32, None),
        (f"{a}.feed_forward_length", spec.n_ff, U32, None),
        (f"{a}.attention.head_count", spec.n_head, U32, None),
    ]
    if spec.per_layer_head_count_kv:
        kv.append((f"{a}.attention.head_count_kv", [spec.n_kv_head] * spec.n_layer, ARR, GGUFValueType.INT32))
    else:
        kv.append((f"{a}.attention.head_count_kv", spec.n_kv_head, U32, None))
    kv += [
        (f"{a}.attention.layer_norm_rms_epsilon", spec.rms_eps, F32, None),
        (f"{a}.rope.freq_base", spec.rope_freq_base, F32, None),
        (f"{a}.rope.dimension_count", spec.n_embd_head, U32, None),
        (f"{a}.attention.key_length", spec.n_embd_head, U32, None),
        (f"{a}.attention.value_length", spec.n_embd_head, U32, None),
        (f"{a}.vocab_size", spec.vocab, U32, None),
    ]
    if spec.tensor_layout == "gemma3":
        kv.append((f"{a}.attention.sliding_window", spec.sliding_window, U32, None))
        if isinstance(spec.swa_pattern, int):
            kv.append((f"{a}.attention.sliding_window_pattern", spec.swa_pattern, U32, None))
        elif spec.swa_pattern is not None:
            pattern = [bool(x) for x in spec.swa_pattern]
            if len(pattern) != spec.n_layer:
                raise ValueError("swa_pattern must have one entry per layer")
            kv.append((f"{a}.attention.sliding_window_pattern", pattern, ARR, GGUFValueType.BOOL))
    kv += [
        ("tokenizer.ggml.model", "llama", STR, None),
        ("tokenizer.ggml.pre", "default", STR, None),
        ("tokenizer.ggml.tokens", tokens, ARR, STR),
        ("tokenizer.ggml.scores", scores, ARR, F32),
        ("tokenizer.ggml.token_type", types, ARR, GGUFValueType.INT32),
        ("tokenizer.ggml.bos_token_id", 1, U32, None),
        ("tokenizer.ggml.eos_token_id", 2, U32, None),
        ("tokenizer.ggml.unknown_token_id", 0, U32, None),
        ("tokenizer.ggml.add_bos_token", True, GGUFValueType.BOOL, None),
        ("tokenizer.ggml.add_eos_token", False, GGUFValueType.BOOL, None),
        ("tokenizer.chat_template", CHAT_TEMPLATE, STR, None),
        ("general.quantization_version", 2, U32, None),
    ]
    kv += list(spec.extra_metadata)
    return kv


def write_synthetic_gguf(
    path: Path | str,
    spec: SyntheticSpec | None = None,
    *,
    progress: ProgressFn | None = None,
    **overrides: Any,
) -> Path:
    """Write a random-weight model of ``spec`` (fields overridable by keyword) to ``path``.

    Deterministic for a given spec (``seed``). Written atomically, one tensor at a time;
    ``progress("write", done_bytes, total_bytes)``. Returns ``path``. Raises ValueError for
    an inconsistent spec.
    """
    spec = dataclasses.replace(spec or SyntheticSpec(), **overrides)
    spec.validate()
    path = Path(path)
    plan = _tensor_plan(spec)
    wdtype = _NP_DTYPE[spec.dtype]

    def dtype_of(kind: str) -> type:
        return wdtype if kind == "w" else np.float32

    total = sum(int(np.prod(shape)) * np.dtype(dtype_of(k)).itemsize for _, shape, k in plan)
    rng = np.random.default_rng(spec.seed)
    make: dict[str, Callable[[tuple[int, ...]], np.ndarray]] = {
        "w": lambda s: _normal(rng, s, spec.weight_scale, wdtype),
        "n": lambda s: (1.0 + _normal(rng, s, 0.1, np.float32)).astype(np.float32),
        "b": lambda s: _normal(rng, s, spec.weight_scale, np.float32),
    }
    with atomic_gguf_writer(path, spec.architecture) as writer:
        for key, value, vtype, sub in _metadata(spec):
            writer.add_key_value(key, value, vtype, sub)
        for name, shape, kind in plan:
            dt = np.dtype(dtype_of(kind))
            writer.add_tensor_info(name, shape, dt, int(np.prod(shape)) * dt.itemsize)
        begin_tensor_data(writer)
        done = 0
        report(progress, "write", 0, total)
        for _name, shape, kind in plan:
            data = make[kind](shape)
            writer.write_tensor_data(data)
            done += data.nbytes
            report(progress, "write", done, total)
    return path


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float, dtype: type) -> np.ndarray:
    out = rng.standard_normal(shape, dtype=np.float32)
    out *= scale
    return out if dtype is np.float32 else out.astype(dtype)
