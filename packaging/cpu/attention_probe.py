"""Attention on a CPU: what the KV cache's type, flash attention and padding do to a
step's cost and to exactness, in one process (no network).

A CPU stage keeps its KV in q8_0 with llama.cpp's flash attention, the configuration in
which every row's result is the same alone, in a window and on any thread count
(docs/engine.md, "Batch invariance"). That attention visits a session's cells one by one
for every row and head, so at long contexts it is a large part of a step, of a verify
window's extra rows and of a prompt's prefill (docs/speculative.md, "What bounds the
gain"). This probe measures other configurations against it. For each configuration
``K/V/FA/PAD`` (K and V cache types, flash attention on or off, every call of fewer rows
padded to PAD rows) it prints one JSON line:

- ``prefill_tok_s``, ``one_row_ms``, ``four_rows_ms`` at each of ``--contexts``
  (a 64-row-chunk prefill up to the context, then the median of 5 one-row steps and of 5
  four-row windows there);
- ``rows_differ`` of ``rows_checked``, ``max_abs_diff``: every row of windows of 2, 3, 4
  and 8 rows against the one-row steps at the same positions, at contexts 16, 200, 600,
  1000 and 1500 (any difference makes speculation change the text).

    python packaging/cpu/attention_probe.py MODEL.gguf [--threads 1]
        [--configs q8_0/q8_0/on/1,f16/f16/off/1,f16/f16/off/2,q8_0/f32/off/1]
        [--contexts 200,1000]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llama_cpp
import numpy as np

import meshnode.engine.stage as stage_mod
from meshnode.engine import EngineConfig, Segment, StageEngine
from meshnode.engine.stage import KV_TYPES

CHECK_CONTEXTS = (16, 200, 600, 1000, 1500)
CHECK_WINDOWS = (2, 3, 4, 8)
CHUNK = 64


def load(path: Path, k: str, v: str, flash: bool, pad: int, threads: int) -> StageEngine:
    # EngineConfig has one kv_type for K and V; the probe sets each through the context
    # parameters llama.cpp gets (the engine's own choice is what it overrides)
    orig = llama_cpp.llama_init_from_model

    def init(model, cparams):
        cparams.type_k, cparams.type_v = KV_TYPES[k], KV_TYPES[v]
        return orig(model, cparams)

    stage_mod.llama_cpp.llama_init_from_model = init
    try:
        return StageEngine(EngineConfig(path, n_ctx=2048, n_batch=CHUNK, n_seq_max=1, n_threads=threads,
                                        kv_type="f16", flash_attn=flash, pad_rows=pad, adapt_threads=False))
    finally:
        stage_mod.llama_cpp.llama_init_from_model = orig


def prefill(eng: StageEngine, tokens: np.ndarray, n: int) -> float:
    """Session 0's first ``n`` tokens in chunks of CHUNK rows (the engine's batch); tok/s."""
    t0 = time.perf_counter()
    eng.run_session(0, 0, tokens[:n], n_logits=0)
    return n / (time.perf_counter() - t0)


def timed(eng: StageEngine, tokens: np.ndarray, pos: int, rows: int, reps: int = 5) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        eng.forward([Segment(0, pos, tokens=tokens[pos:pos + rows], n_logits=rows)], rewind=True)
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def probe(path: Path, spec: str, threads: int, contexts: list[int]) -> dict:
    k, v, fa, pad = spec.split("/")
    eng = load(path, k, v, fa == "on", int(pad), threads)
    tokens = np.random.default_rng(0).integers(100, min(eng.n_vocab, 20000), 1600 + 8).astype(np.int32)
    out: dict = {"config": spec, "threads": threads}
    try:
        for ctx in contexts:
            rate = prefill(eng, tokens, ctx)
            out[f"ctx{ctx}"] = {"prefill_tok_s": round(rate, 1), "one_row_ms": round(timed(eng, tokens, ctx, 1), 2),
                                "four_rows_ms": round(timed(eng, tokens, ctx, 4), 2)}
            eng.drop(0)
        differ = checked = 0
        worst = 0.0
        for ctx in CHECK_CONTEXTS:
            prefill(eng, tokens, ctx)
            singles = [eng.forward([Segment(0, ctx + i, tokens=tokens[ctx + i:ctx + i + 1], n_logits=1)])[0][0]
                       for i in range(max(CHECK_WINDOWS))]
            for w in CHECK_WINDOWS:
                rows = eng.forward([Segment(0, ctx, tokens=tokens[ctx:ctx + w], n_logits=w)], rewind=True)[0]
                for i in range(w):
                    d = float(np.max(np.abs(rows[i] - singles[i])))
                    checked += 1
                    differ += d > 0
                    worst = max(worst, d)
            eng.drop(0)
        out.update(rows_differ=differ, rows_checked=checked, max_abs_diff=worst)
    finally:
        eng.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--configs", default="q8_0/q8_0/on/1,f16/f16/off/1,f16/f16/off/2,q8_0/f32/off/1")
    p.add_argument("--contexts", default="200,1000")
    a = p.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    for spec in a.configs.split(","):
        print(json.dumps(probe(a.model, spec, a.threads, contexts)), flush=True)


if __name__ == "__main__":
    main()
