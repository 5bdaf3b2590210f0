"""Limits that several packages must agree on (a leaf module: it imports nothing).

``MAX_VERIFY_WINDOW``: on llama.cpp's CPU kernels, k rows decoded as one batch give logits
identical to the same rows decoded one by one for k up to 32, and different ones at 64
(docs/engine.md, "Exactness"). Speculative windows, the scheduler's batches and the
drafts a Forward frame may carry stay within it, so a split, a verify window and a plain
step all agree with one node decoding alone.
"""

MAX_VERIFY_WINDOW = 32

# OpenAI's bound on top_logprobs: the API, the final stage and the wire (Segment.flags,
# SegmentResult) all refuse more.
MAX_TOP_LOGPROBS = 20

# Choices of one request (``n``): each holds a sequence slot on every stage.
MAX_CHOICES = 8

# The KV cache types a stage engine accepts (wire Load.kv_type), and the default: with a
# q8_0 cache llama.cpp's CPU flash attention gives every row the same result alone, in a
# batch of any size and on any thread count (docs/engine.md, "Batch invariance"), which
# an f16 cache does not. Every stage of a split uses the coordinator's choice.
KV_CACHE_TYPES = ("q8_0", "f16", "bf16", "f32")
DEFAULT_KV_TYPE = "q8_0"

# Rows a GPU stage runs every small call as (docs/engine.md, "GPU"): a one-row step or a
# verify window of fewer rows is padded with throwaway rows (rolled back at once), so every
# decode step takes the same CUDA kernels and windows reproduce one-row steps bit for bit.
# llama.cpp's quantized vector kernels come in three shapes, by row count (1 | 2-4 | 5-8;
# matrix kernels beyond 8), so padding to 2 makes windows of up to 4 rows exact and padding
# to 5-8 windows of up to 8. Measured on an H200: an 8-row step of an 8B Q4_0 model costs
# twice a 2-row one, so 2 is the default; MESHNODE_GPU_PAD_ROWS (2-8) sets another width on
# a node, for the engines it builds and the windows it sends.
GPU_PAD_ROWS = 2
GPU_PAD_ROWS_ENV = "MESHNODE_GPU_PAD_ROWS"
MAX_GPU_PAD_ROWS = 8


_warned_pad: set[str] = set()


def gpu_pad_rows() -> int:
    """The pad width of this node's GPU engines: $MESHNODE_GPU_PAD_ROWS when it is a
    number in 2..8, else GPU_PAD_ROWS (with a warning, once per value, naming the range)."""
    import os

    raw = os.environ.get(GPU_PAD_ROWS_ENV, "").strip()
    if raw.isdigit() and 2 <= int(raw) <= MAX_GPU_PAD_ROWS:
        return int(raw)
    if raw and raw not in _warned_pad:
        import logging

        _warned_pad.add(raw)
        logging.getLogger("meshnode").warning("%s=%r is not a number in 2..%d; using %d",
                                              GPU_PAD_ROWS_ENV, raw, MAX_GPU_PAD_ROWS, GPU_PAD_ROWS)
    return GPU_PAD_ROWS


def gpu_exact_window_rows(pad_rows: int) -> int:
    """The widest verify window that equals one-row steps on a GPU stage padding every
    call to ``pad_rows`` rows: the largest row count of the kernel shape ``pad_rows``
    falls in."""
    return 4 if pad_rows <= 4 else MAX_GPU_PAD_ROWS
