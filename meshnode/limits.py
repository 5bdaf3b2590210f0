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

# OpenAI's logit_bias: a bias of -100..100 added to a token's logit before sampling (-100
# bans it in practice, 100 all but forces it). The API, the final stage and the wire
# (Segment.bias_ids / bias_values) refuse more entries or larger values.
MAX_LOGIT_BIAS = 1024
MAX_BIAS = 100.0
# OpenAI's presence_penalty and frequency_penalty: -2..2. A step carries the counts of the
# tokens generated before it (Segment.seen_ids / seen_counts): at most one entry per token
# of a vocabulary (the wire's bound on one, as for grammar masks).
MAX_PENALTY = 2.0
MAX_SEEN = 1 << 20
# llama.cpp's repeat_penalty / vLLM's repetition_penalty: a factor above 0 (1: off); past
# 10 a token that appeared is as good as banned. A step carries the context's recent
# tokens it applies to (Segment.recent), at most MAX_SEEN.
MAX_REPEAT_PENALTY = 10.0
# Prompt rows one step may ask the final stage to score (OpenAI's ``echo`` with
# ``logprobs``: each prompt token's logprob given the ones before it; Segment.score). A
# step's rows are a prefill chunk (--batch), and the frame bounds them well below this.
MAX_SCORED = 1 << 16
# Responses API answers a node keeps for ``previous_response_id`` and GET (serve/response_store.py):
# at most this many, their conversations and objects at most this many bytes of JSON in all.
MAX_STORED_RESPONSES = 256
MAX_STORED_RESPONSE_BYTES = 64 << 20

# Choices of one request (``n``): each holds a sequence slot on every stage.
MAX_CHOICES = 8

# llama.cpp's LLAMA_MAX_SEQ: a context holds at most this many sequences, so a node serves
# at most this many requests at once (--parallel) and a stage loads no more (Load.n_seq_max).
MAX_SEQ = 256

# The KV cache types a stage engine accepts (wire Load.kv_type), and the default: with a
# q8_0 cache llama.cpp's CPU flash attention gives every row the same result alone, in a
# batch of any size and on any thread count (docs/engine.md, "Batch invariance"), which
# an f16 cache does not. Every stage of a split uses the coordinator's choice.
KV_CACHE_TYPES = ("q8_0", "f16", "bf16", "f32")
DEFAULT_KV_TYPE = "q8_0"

# Kernel buffer asked for each socket that carries bursts: the QUIC sockets (and their
# fast lane) and the bulk channel's model transfers. asyncio reads one datagram per
# event-loop iteration, so while a step computes on the loop a burst (a 64-row prompt chunk
# in f32: 147 KB for SmolLM2, 1 MiB for an 8B) waits in the socket, and Linux's default
# receive buffer (~208 KB) drops the rest: a dropped lane frame stalls its request a second
# before the step is resent over QUIC (mesh/pipeline.py). The OS caps what is granted
# (Linux: net.core.rmem_max / wmem_max).
SOCKET_BUFFER = 4 * 1024 * 1024

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
# CPU threads a peer may say the stage it serves computes with (its capabilities)
MAX_STAGE_THREADS = 4096


_warned_env: set[tuple[str, str]] = set()


def _env_count(name: str, lo: int, hi: int, default: int, using: str = "") -> int:
    """$name when it is a number in lo..hi, else ``default`` (with a warning, once per
    value, naming the range and ``using``, what the default means, or the default)."""
    import os

    raw = os.environ.get(name, "").strip()
    if raw.isdigit() and lo <= int(raw) <= hi:
        return int(raw)
    if raw and (name, raw) not in _warned_env:
        import logging

        _warned_env.add((name, raw))
        logging.getLogger("meshnode").warning("%s=%r is not a number in %d..%d; using %s",
                                              name, raw, lo, hi, using or default)
    return default


def gpu_pad_rows() -> int:
    """The pad width of this node's GPU engines: $MESHNODE_GPU_PAD_ROWS when it is a
    number in 2..8, else GPU_PAD_ROWS (with a warning naming the range)."""
    return _env_count(GPU_PAD_ROWS_ENV, 2, MAX_GPU_PAD_ROWS, GPU_PAD_ROWS)


# For tests: CPU engines pad like GPU engines (the GPU's call paths: padded steps, sessions
# in alone-alike calls, wide calls with MESHNODE_GPU_STICKY_CALLS) where CI has no GPU. A
# CPU computes every row alike in any of these calls, so answers must not change.
CPU_PAD_ROWS_ENV = "MESHNODE_CPU_PAD_ROWS"


def cpu_pad_rows() -> int:
    """The pad width of this node's CPU engines: 1 (none) unless $MESHNODE_CPU_PAD_ROWS
    is a number in 1..8."""
    return _env_count(CPU_PAD_ROWS_ENV, 1, MAX_GPU_PAD_ROWS, 1)


# CPU engines adapt their llama.cpp thread count to the cores the machine has free
# (engine/threads.py); MESHNODE_ADAPT_THREADS=0 keeps every engine at its configured count.
ADAPT_THREADS_ENV = "MESHNODE_ADAPT_THREADS"


def adapt_threads() -> bool:
    """Whether this node's CPU engines adapt their thread count: $MESHNODE_ADAPT_THREADS
    is 1 (the default) or 0."""
    return bool(_env_count(ADAPT_THREADS_ENV, 0, 1, 1))


# How many calls a GPU stage keeps padding its small calls to the widest exact width
# (gpu_exact_window_rows: 4 rows at pad 2) after a verify window wider than its pad width
# (StageEngine._width), where that wins. llama.cpp replays a captured CUDA graph while
# consecutive calls keep one shape and runs calls without one when the shape changes (then
# captures again): with SmolLM2's shape on an H200 a call in a run of one shape took 1.5 ms,
# a call after a change 4.4-6 ms, and padding to 4 rows cost 0.3 ms a call
# (packaging/gpu/step_probe.py); on the 8B shape padding to 4 cost 1.3 ms a step and a call
# without its graph ~1.1 ms. So each GPU engine times the three at load
# (engine/callshape.py) and stays wide for GPU_STICKY_CALLS calls only where that wins
# (SmolLM2's shape: yes; the 8B shape sits at the edge and went either way on two H200s);
# $MESHNODE_GPU_STICKY_CALLS (a number of calls, 0 = never) sets it for a node's engines.
GPU_STICKY_CALLS = 32
GPU_STICKY_CALLS_ENV = "MESHNODE_GPU_STICKY_CALLS"


def gpu_sticky_calls() -> int | None:
    """$MESHNODE_GPU_STICKY_CALLS when it is a number (0 = never); None when it is unset or
    not a number (with a warning): then each GPU engine decides by timing itself."""
    calls = _env_count(GPU_STICKY_CALLS_ENV, 0, 1 << 30, -1, "each engine's timing")
    return None if calls < 0 else calls


# llama.cpp attends, in every call, the KV cells of a sequence up to the last one in use
# rounded up to a multiple of KV_BUCKET (its n_kv, llama_kv_cache::get_n_kv, the current
# call's cells included). On CPU that length changes nothing (flash attention skips masked
# cells exactly); on CUDA the attention kernels split their sums by it, so a row computed
# inside a window that ends before a bucket's edge, while its one-row step would reach past
# it, rounds differently (measured on an H200: certify --schedule differs in exactly that
# row, docs/engine.md "GPU"). A GPU route therefore never lets a window straddle an edge
# its one-row steps would cross (gpu_bucket_drafts).
KV_BUCKET = 256


def kv_bucket(cells: int) -> int:
    """Which KV_BUCKET a sequence's first ``cells`` cells end in (1 for 1..256): llama.cpp
    attends ``kv_bucket(cells) * KV_BUCKET`` cells in a call that fills them."""
    return -(-cells // KV_BUCKET)


def gpu_bucket_drafts(pos: int, pad_rows: int) -> int:
    """The most drafts a verify window starting at position ``pos`` may carry on a GPU
    stage that pads calls to ``pad_rows`` rows, so that each of its rows attends as many KV
    cells as its own one-row step would: the window's cells and those of every row's
    padded one-row step end in the same KV_BUCKET (a sequence's cells hold positions 0, 1,
    ... in order). 0 where the one-row step at ``pos`` already fills its bucket."""
    edge = pos + max(1, pad_rows)
    return kv_bucket(edge) * KV_BUCKET - edge


def gpu_exact_window_rows(pad_rows: int) -> int:
    """The widest verify window that equals one-row steps on a GPU stage padding every
    call to ``pad_rows`` rows: the largest row count of the kernel shape ``pad_rows``
    falls in."""
    return 4 if pad_rows <= 4 else MAX_GPU_PAD_ROWS
