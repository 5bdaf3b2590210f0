"""argparse ``type=`` helpers shared by the command line and the benchmarks.

Each turns one argument's text into a value or raises ``argparse.ArgumentTypeError``
with a one-line message (argparse prints it and exits with status 2). They live in this
leaf module rather than in :mod:`meshnode.cli` so that the benchmarks, which the CLI
dispatches to, can use them without importing the CLI back.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable

from meshnode.limits import MAX_SEQ, MAX_VERIFY_WINDOW


def _int(text: str, what: str = "a whole number") -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1, with a one-line error otherwise."""
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {v}")
    return v


def non_negative_int(text: str) -> int:
    """argparse type: a whole number >= 0 (a count that may be zero)."""
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {v}")
    return v


def int_up_to(most: int, why: str) -> Callable[[str], int]:
    """argparse type: a whole number 1..``most``; ``why`` says where the bound comes from."""
    def parse(text: str) -> int:
        v = positive_int(text)
        if v > most:
            raise argparse.ArgumentTypeError(f"at most {most} ({why}), got {v}")
        return v
    return parse


# a verify window's size in drafts: the rows llama.cpp computes alike however they are
# batched (meshnode.limits)
draft_window = int_up_to(MAX_VERIFY_WINDOW, "rows computed alike in one batch")
# requests a node serves at once: each holds one of llama.cpp's sequences
parallel_requests = int_up_to(MAX_SEQ, "llama.cpp's sequences per context")


def port(text: str) -> int:
    """argparse type: a TCP/UDP port, 0 (any free port) to 65535."""
    v = _int(text, "a port number")
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {v}")
    return v


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return v


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0, with a one-line error otherwise."""
    v = _float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a duration, a timeout), with a one-line error otherwise."""
    v = _float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return v


def size(text: str) -> int:
    """argparse type: a byte size such as ``6GB`` or ``512MiB`` (:func:`meshnode.config.parse_size`)."""
    from meshnode.config import ConfigError, parse_size
    try:
        return parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# Linux numbers at most 8192 CPUs (CONFIG_NR_CPUS); a bigger number is a typo, and
# "0-4000000000" must not build a set of four billion.
MAX_CPU = 8191


def cpu_list(text: str) -> frozenset[int]:
    """argparse type: CPU numbers like ``0``, ``0,2`` or ``0-3`` (``taskset -c`` syntax)."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if first < 0 or last < first or last > MAX_CPU:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected CPU numbers 0-{MAX_CPU} like 0, 0,2 or 0-3, got {text!r}") from None
    return frozenset(cpus)


def cpu_ranges(cpus: Iterable[int]) -> str:
    """CPU numbers written the way :func:`cpu_list` reads them: ``0-3,6``."""
    runs: list[list[int]] = []   # [first, last] of each run of consecutive numbers
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


GPU_LAYERS_HELP = ("layers of each slice this node runs to offload to its GPU: a number, 'all' or "
                   "'auto' (default: as many as the free VRAM holds; 0 without a GPU build of llama.cpp)")


def gpu_layers(text: str) -> int:
    """argparse type: ``--gpu-layers`` as a count, ``all`` or ``auto`` (the engine's
    ``offload.GPU_LAYERS_ALL`` / ``GPU_LAYERS_AUTO``; the values are repeated here so
    that parsing a flag does not import llama.cpp)."""
    word = text.strip().lower()
    if word == "auto":
        return -1
    if word == "all":
        return 1 << 20
    v = _int(text, "a number of layers, 'all' or 'auto'")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a number of layers >= 0, 'all' or 'auto', got {v}")
    return min(v, 1 << 20)


def gpu_layers_flag(value: int) -> str:
    """The ``--gpu-layers`` text for a value :func:`gpu_layers` parsed (benchmarks pass
    theirs on to the nodes they start)."""
    return {-1: "auto", 1 << 20: "all"}.get(value, str(value))
