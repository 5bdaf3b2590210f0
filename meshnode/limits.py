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
