"""Soak: mixed traffic on a 3-node split while members are killed and restarted.

What a mesh of laptops does to a model all day, compressed: clients stream and wait,
some hang up part way, speculation is on, and every ``--kill-every`` seconds a random
member that is not the coordinator is killed with SIGKILL and started again
``--down`` seconds later (same home, so it comes back as the same node).

Every greedy answer is compared with a reference taken before the first kill, from the
same cluster, one request at a time. The report counts what the user would notice:

- requests completed, failed (by HTTP status or error chunk), cancelled by the client;
- tokens lost or repeated: the answer is the reference with a piece missing or a piece
  said twice (the signature of a failover that replays the wrong positions);
- greedy mismatches: any other difference from the reference;
- time to resume: for each request in flight at a kill, the longest gap between two
  chunks that spans the kill (p50, p95);
- memory over time: each node's resident set, sampled every few seconds.

Lost, repeated and mismatched must all be 0.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from meshnode.argtypes import non_negative_float, non_negative_int, positive_float, positive_int

HELP = "soak: mixed traffic on a 3-node split while members are killed and restarted"

PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a hash table is in three sentences.",
    "List five fruits and one fact about each.",
    "Write a Python function that reverses a string, with a docstring.",
    "Describe a sunrise over the mountains.",
    "What are the rules of tic-tac-toe?",
    "Give three tips for writing clear emails.",
    "Tell a story about a robot who learns to paint.",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF or store name (default: the default model)")
    p.add_argument("--minutes", type=positive_float, default=10.0, help="how long to run the traffic (default 10)")
    p.add_argument("--kill-every", type=positive_float, default=30.0, metavar="S",
                   help="seconds between kills of a random non-coordinator member (default 30)")
    p.add_argument("--down", type=non_negative_float, default=None, metavar="S",
                   help="seconds a killed member stays down before it restarts (default: half of --kill-every)")
    p.add_argument("--nodes", type=positive_int, default=3, help="nodes in the split (default 3)")
    p.add_argument("--spare", type=non_negative_int, default=1,
                   help="extra members that hold the model but start idle, to take a lost range (default 1)")
    p.add_argument("--clients", type=positive_int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--tokens", type=positive_int, default=48, help="max tokens per request (default 48)")
    p.add_argument("--cancel-rate", type=non_negative_float, default=0.15,
                   help="share of streams the client abandons part way (default 0.15)")
    p.add_argument("--threads", type=positive_int, default=1, help="llama.cpp threads per stage (default 1)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the schedule (default 0)")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="put the nodes' homes (their node.log included) under DIR and keep them "
                        "after the run (default: a temporary directory, removed)")
    p.add_argument("--node-log-level", default="info", choices=("debug", "info", "warning"),
                   help="the nodes' log level (default info; debug with --keep to trace a failure)")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")


# -- pure logic: how an answer differs from the reference ----------------------------------

def classify(reference: str, got: str) -> str:
    """``"same"``, ``"lost"`` (a piece of the reference is missing), ``"repeated"`` (a
    piece is said twice) or ``"mismatch"``. A shorter answer that is a prefix of the
    reference is ``"same"`` (a stop, or the client hung up)."""
    if got == reference or reference.startswith(got):
        return "same"
    ops = [op for op in difflib.SequenceMatcher(None, reference, got, autojunk=False).get_opcodes()
           if op[0] != "equal"]
    if len(ops) == 1:
        tag, i1, i2, j1, j2 = ops[0]
        if tag == "delete":
            return "lost"
        if tag == "insert":
            piece = got[j1:j2]
            # said twice: the inserted text repeats what comes just before or after it
            if got[j1 - len(piece):j1] == piece or got[j2:j2 + len(piece)] == piece:
                return "repeated"
    return "mismatch"


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


# -- the run ---------------------------------------------------------------------------------

@dataclass
class _Result:
    prompt: int
    stream: bool
    cancelled: bool = False
    status: str = "ok"           # ok | http NNN | error chunk | exception
    detail: str = ""             # why it failed: the error's message (the first 200 characters)
    text: str = ""
    stamps: list[float] = field(default_factory=list)
    t0: float = 0.0
    t1: float = 0.0


def _request(base: str, model: str, prompt: int, tokens: int, *, stream: bool, cancel_after: int | None) -> _Result:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[prompt]}],
            "max_tokens": tokens, "temperature": 0, "stream": stream}
    res = _Result(prompt, stream, t0=time.monotonic())
    try:
        with httpx.Client(timeout=120, trust_env=False) as c:
            if not stream:
                r = c.post(f"{base}/chat/completions", json=body)
                if r.status_code != 200:
                    res.status, res.detail = f"http {r.status_code}", r.text[:200]
                else:
                    res.text = r.json()["choices"][0]["message"].get("content") or ""
                    res.stamps.append(time.monotonic())
            else:
                with c.stream("POST", f"{base}/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        r.read()
                        res.status, res.detail = f"http {r.status_code}", r.text[:200]
                    else:
                        for line in r.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                res.status = "error chunk"
                                res.detail = str((chunk["error"] or {}).get("message", chunk["error"]))[:200]
                                break
                            piece = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
                            if piece:
                                res.text += piece
                                res.stamps.append(time.monotonic())
                                if cancel_after is not None and len(res.stamps) >= cancel_after:
                                    res.cancelled = True
                                    break
    except Exception as exc:  # noqa: BLE001 - a soak counts failures, whatever they are
        res.status, res.detail = f"exception {type(exc).__name__}", str(exc)[:200]
    res.t1 = time.monotonic()
    return res


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _resume_times(results: list[_Result], kills: list[float]) -> list[float]:
    """For each request in flight at a kill, the longest gap between two of its chunks
    (or its start and first chunk) that spans the kill."""
    out = []
    for k in kills:
        for r in results:
            if not r.stream or r.status != "ok" or not (r.t0 <= k <= r.t1):
                continue
            marks = [r.t0, *r.stamps]
            gaps = [b - a for a, b in zip(marks, marks[1:]) if a <= k <= b]
            if gaps:
                out.append(max(gaps))
    return out


def _summarize(results: list[_Result], reference: dict[int, str], kills: list[float],
               memory: dict[str, list[float]], minutes: float) -> dict:
    counts = {"same": 0, "lost": 0, "repeated": 0, "mismatch": 0}
    failed: dict[str, int] = {}
    why: dict[str, int] = {}
    for r in results:
        if r.status != "ok":
            failed[r.status] = failed.get(r.status, 0) + 1
            key = f"{r.status}: {r.detail}"
            why[key] = why.get(key, 0) + 1
            continue
        counts[classify(reference[r.prompt], r.text)] += 1
    resume = _resume_times(results, kills)
    ok = [r for r in results if r.status == "ok"]
    return {
        "minutes": minutes, "kills": len(kills),
        "requests": len(results), "completed": len(ok), "cancelled": sum(r.cancelled for r in ok),
        "failed": sum(failed.values()), "failed_by_reason": failed,
        "failures": [{"error": k, "count": n} for k, n in sorted(why.items(), key=lambda kv: -kv[1])[:10]],
        "tokens_lost": counts["lost"], "tokens_repeated": counts["repeated"],
        "greedy_mismatches": counts["mismatch"],
        "resume_s": {"n": len(resume), "p50": percentile(resume, 50), "p95": percentile(resume, 95)},
        "memory_mb": {name: {"start": s[0], "max": max(s), "end": s[-1]} for name, s in memory.items() if s},
    }


def _print(out: dict) -> None:
    print(f"soak: {out['minutes']:.1f} min, {out['kills']} kill(s)")
    print(f"  requests {out['requests']}: completed {out['completed']} (cancelled by client "
          f"{out['cancelled']}), failed {out['failed']} {out['failed_by_reason'] or ''}")
    for f in out["failures"]:
        print(f"    {f['count']} x {f['error']}")
    print(f"  tokens lost {out['tokens_lost']}, repeated {out['tokens_repeated']}, "
          f"greedy mismatches {out['greedy_mismatches']} (all must be 0)")
    rs = out["resume_s"]
    if rs["n"]:
        print(f"  time to resume over {rs['n']} in-flight stream(s): p50 {rs['p50']:.2f} s, p95 {rs['p95']:.2f} s")
    else:
        print("  time to resume: no stream was in flight at a kill")
    for name, m in out["memory_mb"].items():
        print(f"  {name} RSS MB: start {m['start']:.0f}, max {m['max']:.0f}, end {m['end']:.0f}")


def run(args: argparse.Namespace) -> int:
    from meshnode.bench.cluster import LocalCluster
    from meshnode.models.store import resolve_model
    from meshnode.paths import NodePaths

    if args.cancel_rate > 1 or args.nodes < 2:
        print("meshnode bench soak: --cancel-rate must be in [0, 1] and --nodes >= 2", file=sys.stderr)
        return 2
    if args.keep is not None and args.keep.exists() and (not args.keep.is_dir() or any(args.keep.iterdir())):
        print(f"meshnode bench soak: --keep {args.keep}: not an empty directory", file=sys.stderr)
        return 2
    down = args.kill_every / 2 if args.down is None else args.down
    logging.getLogger("httpx").setLevel(logging.WARNING)
    paths = NodePaths.resolve(args.home).ensure()
    ref = resolve_model(args.model, paths)
    rng = random.Random(args.seed)
    n_total = args.nodes + args.spare
    print(f"soak: {args.nodes}-stage split + {args.spare} spare, {args.clients} client(s), "
          f"kill every {args.kill_every:g} s (down {down:g} s), {args.minutes:g} min", file=sys.stderr)
    if args.keep is not None:   # (LocalCluster makes the directory)
        print(f"  node homes and logs kept in {args.keep}", file=sys.stderr)
    with LocalCluster(ref.path, n_total, root=args.keep) as cluster:
        def start_member(i: int):
            return cluster.start(i, "--no-model", "--threads", str(args.threads),
                                 "--parallel", str(args.clients), log_level=args.node_log_level)

        members = {i: start_member(i) for i in range(1, n_total)}
        coord = cluster.start(0, "--model", str(ref.path), "--split", str(args.nodes), "--threads",
                              str(args.threads), "--parallel", str(args.clients), "--spec-mode", "on",
                              "--ctx", "1024", log_level=args.node_log_level).wait_model()
        base, model = coord.base_url, coord.get("/v1/models")["data"][0]["id"]
        print("  reference answers (one at a time, before any kill) ...", file=sys.stderr)
        reference = {i: _request(base, model, i, args.tokens, stream=False, cancel_after=None).text
                     for i in range(len(PROMPTS))}
        stop = threading.Event()
        results: list[_Result] = []
        kills: list[float] = []
        memory: dict[str, list[float]] = {}
        lock = threading.Lock()

        def client(k: int) -> None:
            crng = random.Random(args.seed * 1000 + k)
            while not stop.is_set():
                stream = crng.random() < 0.7
                cancel = crng.randint(2, max(2, args.tokens // 2)) if stream and crng.random() < args.cancel_rate else None
                r = _request(base, model, crng.randrange(len(PROMPTS)), args.tokens, stream=stream, cancel_after=cancel)
                with lock:
                    results.append(r)

        def sampler() -> None:
            while not stop.wait(3.0):
                for name, node in [("coordinator", coord), *((f"node{i}", n) for i, n in members.items())]:
                    mb = _rss_mb(node.proc.pid) if node.proc.poll() is None else None
                    if mb is not None:
                        memory.setdefault(name, []).append(mb)

        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
        threads.append(threading.Thread(target=sampler, daemon=True))
        for t in threads:
            t.start()
        end = time.monotonic() + args.minutes * 60
        try:
            while time.monotonic() + args.kill_every < end:
                time.sleep(args.kill_every)
                victim = rng.choice(sorted(members))
                print(f"  kill -9 node{victim}", file=sys.stderr)
                members[victim].proc.kill()
                members[victim].proc.wait()
                kills.append(time.monotonic())
                time.sleep(min(down, max(0.0, end - time.monotonic())))
                members[victim] = start_member(victim)
            time.sleep(max(0.0, end - time.monotonic()))
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=130)
    out = _summarize(results, reference, kills, memory, args.minutes)
    _print(out)
    if args.json:
        print(json.dumps(out))
    return 0
