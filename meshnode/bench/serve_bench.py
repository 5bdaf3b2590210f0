"""Single node vs 2- and 3-stage splits on loopback, through the real HTTP endpoint.

Every configuration runs in this one invocation, so the ratios compare like with like:
real node processes (own homes, real mDNS + QUIC on loopback), speculation off, the same
llama.cpp thread count on every stage. Also measured here: the ceiling for concurrency,
i.e. what the same engine reaches decoding one batch of B sessions directly in-process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HELP = "serving benchmark: single node vs 2/3-stage splits (decode, TTFT, prefill, concurrency)"

STORY = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."
LONG_PROMPT = ("Summarize the following notes in one sentence.\n" +
               "\n".join(f"- Note {i}: the meeting about topic {i} moved to room {i % 7}." for i in range(24)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF or store name (default: the default model)")
    p.add_argument("--big", action="store_true",
                   help="also run a random-weight ~1B llama (written once into the cache; slow)")
    p.add_argument("--stages", default="1,2,3", help="stage counts to run (default 1,2,3)")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads per stage (default 1)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream (default 64)")
    p.add_argument("--concurrency", default="1,4,8", help="concurrent streams (default 1,4,8)")
    p.add_argument("--quick", action="store_true", help="fewer tokens and configurations")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")


def _stream(base: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat completion: TTFT, tokens, timings."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = t_first = None
    stamps: list[float] = []
    usage = timings = None
    with httpx.Client(timeout=600) as c, c.stream("POST", f"{base}/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code} from the node: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
                if ttft is None:
                    t_first = stamps[-1]
                    ttft = t_first - t0
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    return {"ttft_s": ttft, "wall_s": time.perf_counter() - t0, "t_first": t_first or t0, "stamps": stamps,
            "t_end": time.perf_counter(),
            "tokens": (usage or {}).get("completion_tokens", 0), "timings": timings or {}}


def _measure_endpoint(base: str, model: str, tokens: int, concurrency: list[int]) -> dict:
    _stream(base, model, "Hello", 4)  # warm-up
    single = [_stream(base, model, STORY, tokens) for _ in range(2)]
    decode = statistics.median(s["timings"].get("predicted_per_second", 0.0) for s in single)
    ttft = statistics.median(s["ttft_s"] or 0.0 for s in single)
    pre = _stream(base, model, LONG_PROMPT, 1)
    prefill = pre["timings"].get("prompt_per_second", 0.0)
    agg = {}
    for c in concurrency:
        # Aggregate decode throughput in the steady state: text chunks (~tokens) that
        # arrive while every stream is decoding, i.e. between the last stream's first
        # token and the first stream's end, over that window.
        with ThreadPoolExecutor(c) as ex:
            results = list(ex.map(lambda _: _stream(base, model, STORY, tokens), range(c)))
        lo = max(r["t_first"] for r in results)
        hi = min(r["stamps"][-1] if r["stamps"] else r["t_end"] for r in results)
        n = sum(sum(1 for t in r["stamps"] if lo < t <= hi) for r in results)
        agg[str(c)] = n / (hi - lo) if hi > lo else 0.0
    return {"decode_tok_s": decode, "ttft_ms": 1e3 * ttft, "prefill_tok_s": prefill,
            "prefill_tokens": pre["timings"].get("prompt_n", 0), "aggregate_tok_s": agg}


def _engine_ceiling(model_path, threads: int, sizes: list[int], steps: int = 16) -> dict:
    """Tokens/s of the same engine decoding one batch of B sessions directly."""
    import numpy as np

    from meshnode.engine import EngineSpec, Segment, StageEngine

    out = {}
    with StageEngine(EngineSpec(model_path, n_ctx=256, n_batch=64, n_seq_max=max(sizes),
                                n_threads=threads)) as eng:
        for b in sizes:
            for s in range(b):
                eng.drop(s)
                eng.forward([Segment(s, 0, tokens=np.arange(1, 17, dtype=np.int32), n_logits=1)])
            times = []
            for k in range(steps):
                segs = [Segment(s, 16 + k, tokens=np.asarray([5 + s], dtype=np.int32), n_logits=1)
                        for s in range(b)]
                t0 = time.perf_counter()
                eng.forward(segs)
                times.append(time.perf_counter() - t0)
            out[str(b)] = b / statistics.median(times)
            for s in range(b):
                eng.drop(s)
    return out


def _run_model(model_ref, args, stage_counts, concurrency) -> dict:
    from meshnode.bench.cluster import LocalCluster

    results = {}
    flags = ("--threads", str(args.threads), "--parallel", str(max(concurrency)), "--ctx", "1024",
             "--batch", "64", "--spec-mode", "off", "--model", str(model_ref.path))
    for n in stage_counts:
        print(f"  {model_ref.name}: {n} stage(s) ...", file=sys.stderr, flush=True)
        with LocalCluster(model_ref.path, n) as cluster:
            for i in range(1, n):
                cluster.start(i, "--no-model", "--threads", str(args.threads), "--parallel",
                              str(max(concurrency)))
            coord = cluster.start(0, *flags, "--split", str(n)).wait_model()
            model = coord.get("/v1/models")["data"][0]["id"]
            results[str(n)] = _measure_endpoint(coord.base_url, model, args.tokens, concurrency)
    results["ceiling_tok_s"] = _engine_ceiling(model_ref.path, args.threads, concurrency)
    return results


def _print(name: str, res: dict, stage_counts: list[int], concurrency: list[int]) -> None:
    base = res["1"] if "1" in res else None
    print(f"\n{name}")
    print(f"{'stages':>6} {'decode tok/s':>13} {'ratio':>6} {'TTFT ms':>8} {'prefill tok/s':>14} "
          + " ".join(f"{'agg@' + str(c):>8}" for c in concurrency))
    for n in stage_counts:
        r = res[str(n)]
        ratio = r["decode_tok_s"] / base["decode_tok_s"] if base and base["decode_tok_s"] else float("nan")
        print(f"{n:>6} {r['decode_tok_s']:>13.1f} {ratio:>6.2f} {r['ttft_ms']:>8.0f} "
              f"{r['prefill_tok_s']:>14.1f} " + " ".join(f"{r['aggregate_tok_s'][str(c)]:>8.1f}" for c in concurrency))
    ceil = res["ceiling_tok_s"]
    print("engine ceiling (one batch, in-process): " +
          ", ".join(f"B={c}: {ceil[str(c)]:.1f} tok/s" for c in concurrency))
    for n in stage_counts:
        r = res[str(n)]
        print(f"  {n} stage(s) aggregate / ceiling: " + ", ".join(
            f"@{c}: {r['aggregate_tok_s'][str(c)] / ceil[str(c)]:.2f}" for c in concurrency))


def run(args: argparse.Namespace) -> int:
    import os

    from meshnode.models.store import resolve_model
    from meshnode.paths import NodePaths

    if args.quick:
        args.tokens = min(args.tokens, 32)
    stage_counts = [int(x) for x in args.stages.split(",")]
    concurrency = [int(x) for x in args.concurrency.split(",")]
    paths = NodePaths.resolve(args.home).ensure()
    print(f"serve benchmark: loopback, {args.threads} thread(s) per stage, speculation off, "
          f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    out = {}
    ref = resolve_model(args.model, paths)
    out[ref.name] = _run_model(ref, args, stage_counts, concurrency)
    _print(ref.name, out[ref.name], stage_counts, concurrency)
    if args.big:
        from meshnode.models.store import model_ref_for_path
        from meshnode.models.synthetic import LLAMA_1B, write_synthetic_gguf

        big = paths.cache / "bench" / "random-llama-1b-f16.gguf"
        if not big.exists():
            print("writing a random-weight ~1B llama (once) ...", file=sys.stderr)
            write_synthetic_gguf(big, LLAMA_1B)
        bref = model_ref_for_path(big, paths)
        big_args = argparse.Namespace(**{**vars(args), "tokens": min(args.tokens, 16)})
        out[bref.name] = _run_model(bref, big_args, [n for n in stage_counts if n <= 2], [1])
        _print(bref.name, out[bref.name], [n for n in stage_counts if n <= 2], [1])
    if args.json:
        print(json.dumps(out))
    return 0
