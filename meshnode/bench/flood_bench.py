"""`meshnode bench flood`: a non-member floods a node; does the node keep its memory, its
links and its answers? (docs/security.md)

The victim is a real node process (``meshnode serve``, own home, loopback only) serving a
real model over its OpenAI endpoint: the default model from the store (SmolLM2), the one
``--model`` names, or, when the default model is not available (offline) or with
``--model synthetic``, a small random-weight llama (:mod:`meshnode.models.synthetic`); the
output says which. A second node of the same mesh, the member, dials it (``--peer``, no
mDNS) and, with ``--split 2`` (the default), holds the model's second stage, so every
chat completion crosses the member's authenticated link; with ``--split 1`` the member
is an idle peer and the victim serves alone.

A client process (its own, so that the flood's Python does not slow the client) sends
greedy chat completions one after the other to 127.0.0.1: first ``--requests`` of them
as the baseline, then in a loop for as long as the flood lasts (at most
:data:`MAX_FLOOD_REQUESTS`). This process is the stranger: with its own self-signed
certificates and no secret (:mod:`meshnode.net.flood`) it opens ``--connections`` QUIC
connections to the victim, ``--parallel`` at a time, each opening ``--streams`` streams
that carry a frame header declaring the largest frame (64 MiB) and ``--payload`` bytes,
for at most ``--duration`` seconds. It samples the victim's resident memory
(``/proc/PID/status``) every 50 ms from after the baseline (the model's pages are warm
then) and reports the growth, how long the stranger's connections lived, whether the
member's link stayed up (the victim's log never says the member was lost or
re-authenticated, and ``/status`` lists it authenticated at the end), and the chat
completions during the flood against the baseline: ok/failed, latency p50/max and their
ratios, and whether every greedy answer stayed the baseline's; the baseline's loop runs
once more after the flood, so that a slow spell of a shared machine shows as one (the
ratios are against the baseline before). Loopback only; bounded in
count and time. Exit status 1 when the memory grew by more than ``--max-growth-mb``, a
request failed, an answer changed or the link was lost.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from meshnode.argtypes import non_negative_float, positive_int
from meshnode.bench.errors import BenchError

HELP = ("flood a node that serves a model from a non-member (connections, streams, max-size frames): "
        "memory growth, links, serving, lifetimes")

PROMPT = "Name three colours of the rainbow."
MAX_FLOOD_REQUESTS = 1000     # the client's loop during the flood stops here at the latest
REQUEST_TIMEOUT_S = 30.0      # one chat completion slower than this counts as failed
SYNTHETIC = "synthetic"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connections", type=positive_int, default=200, help="stranger connections in all (default 200)")
    parser.add_argument("--parallel", type=positive_int, default=20, help="connections at a time (default 20)")
    parser.add_argument("--streams", type=positive_int, default=20, help="streams per connection (default 20)")
    parser.add_argument("--payload", type=int, default=0, help="payload bytes after each header (default 0)")
    parser.add_argument("--duration", type=non_negative_float, default=20.0, help="stop flooding after this many s (default 20)")
    parser.add_argument("--max-growth-mb", type=non_negative_float, default=50.0,
                        help="fail (exit 1) when the victim grew by more (default 50)")
    parser.add_argument("--model", default=None,
                        help="GGUF or store name the victim serves (default: the default model; "
                             f"'{SYNTHETIC}': a small random-weight llama, also used when the default "
                             "model cannot be had)")
    parser.add_argument("--split", type=int, choices=(1, 2), default=2,
                        help="2: the member holds the second stage, so requests cross its link (default); "
                             "1: the victim serves alone, the member is an idle peer")
    parser.add_argument("--requests", type=positive_int, default=10,
                        help="chat completions of the baseline before the flood (default 10); during the "
                             "flood the client loops until the flood ends")
    parser.add_argument("--max-tokens", type=positive_int, default=16,
                        help="tokens per chat completion (default 16)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# -- the client: greedy chat completions, one at a time, in a process of its own ----------


def _complete(client, base: str, model: str, max_tokens: int) -> dict:  # type: ignore[no-untyped-def]
    import time

    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0}
    t0 = time.perf_counter()
    try:
        r = client.post(f"{base}/chat/completions", json=body)
        ms = (time.perf_counter() - t0) * 1e3
        if r.status_code != 200:
            return {"ok": False, "ms": ms, "error": f"HTTP {r.status_code}: {r.text[:200]}"}
        return {"ok": True, "ms": ms, "text": r.json()["choices"][0]["message"]["content"]}
    except Exception as exc:   # a refused or timed-out request is a result of the bench, not a crash
        return {"ok": False, "ms": (time.perf_counter() - t0) * 1e3, "error": f"{type(exc).__name__}: {exc}"}


def _client(conn, base: str, model: str, max_tokens: int) -> None:  # type: ignore[no-untyped-def]
    """The client process: ``("run", n)`` runs n requests; ``("loop", n)`` runs requests
    until anything arrives on ``conn`` (or n of them); both answer the list of results."""
    import httpx

    # loopback only: never through a proxy the environment names
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        while True:
            cmd = conn.recv()
            if cmd[0] == "quit":
                return
            results = []
            while len(results) < cmd[1] and not (cmd[0] == "loop" and conn.poll()):
                results.append(_complete(client, base, model, max_tokens))
            if cmd[0] == "loop":
                conn.recv()   # the stop
            conn.send(results)


@dataclass(frozen=True, slots=True)
class _Phase:
    ok: int
    failed: int
    p50_ms: float | None
    max_ms: float | None
    errors: tuple[str, ...]

    @staticmethod
    def of(results: list[dict]) -> "_Phase":
        ms = sorted(r["ms"] for r in results if r["ok"])
        return _Phase(ok=len(ms), failed=len(results) - len(ms),
                      p50_ms=round(ms[len(ms) // 2], 1) if ms else None,
                      max_ms=round(ms[-1], 1) if ms else None,
                      errors=tuple(sorted({r["error"][:120] for r in results if not r["ok"]}))[:5])


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


# -- the stranger ----------------------------------------------------------------------------


async def _flood(args: argparse.Namespace, port: int, pid: int) -> dict:
    import asyncio
    import time

    from meshnode.net.flood import stranger_connection

    rss0 = _rss(pid)
    peak = rss0
    results = []
    started = 0
    t_end = time.monotonic() + args.duration

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, _rss(pid))
            await asyncio.sleep(0.05)

    async def worker() -> None:
        nonlocal started
        while started < args.connections and time.monotonic() < t_end:
            started += 1
            results.append(await stranger_connection("127.0.0.1", port, streams=args.streams,
                                                     payload=args.payload, hold_s=5.0))

    sampler = asyncio.ensure_future(sample())
    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(args.parallel)))
    elapsed = time.monotonic() - t0
    await asyncio.sleep(0.5)
    after = _rss(pid)
    sampler.cancel()
    lived = sorted(r.lived_s for r in results if r.connected)
    return {
        "connections": len(results), "connected": len(lived), "not_connected": len(results) - len(lived),
        "closed_by_node": sum(r.closed_by_node for r in results),
        "flood_s": round(elapsed, 1),
        "lived_ms_median": round(lived[len(lived) // 2] * 1e3, 1) if lived else None,
        "lived_ms_max": round(lived[-1] * 1e3, 1) if lived else None,
        "reasons": sorted({r.reason.split(":")[0] for r in results}),
        "rss_before_mb": round(rss0 / 2**20, 1), "rss_peak_growth_mb": round((peak - rss0) / 2**20, 1),
        "rss_growth_after_mb": round((after - rss0) / 2**20, 1),
    }


# -- the victim and the member ---------------------------------------------------------------


def _model(args: argparse.Namespace, paths):  # type: ignore[no-untyped-def]
    """(ModelRef, how it was chosen) for the victim; see the module docstring."""
    from meshnode.errors import MeshnodeError
    from meshnode.models.store import model_ref_for_path, resolve_model
    from meshnode.models.synthetic import write_synthetic_gguf

    why = ""
    if args.model != SYNTHETIC:
        try:
            ref = resolve_model(args.model, paths)
            return ref, ("the default model, from the store" if args.model is None else "given with --model")
        except MeshnodeError as exc:
            if args.model is not None:
                raise
            why = f"; the default model is not available: {exc}"
    path = paths.cache / "bench" / "flood-random-llama.gguf"
    if not path.exists():
        write_synthetic_gguf(path, n_layer=4, n_embd=128, n_head=4, n_kv_head=2, n_ff=256)
    return model_ref_for_path(path, paths), "random weights (meshnode.models.synthetic)" + why


def _link_events(log: str, member_id: str) -> tuple[int, int]:
    """(authentications, losses) of the member in the victim's log (mesh.fabric's lines)."""
    auth = lost = 0
    for line in log.splitlines():
        if f"peer {member_id} " in line:
            auth += line.rstrip().endswith("authenticated")
            lost += f"peer {member_id} lost" in line
    return auth, lost


def _member_authenticated(victim, member_id: str) -> bool:  # type: ignore[no-untyped-def]
    try:
        peers = victim.get("/status")["peers"]
    except (OSError, ValueError):
        return False
    return any(p["node_id"] == member_id and p["authenticated"] for p in peers)


def _bench(args: argparse.Namespace) -> dict:
    import asyncio
    import multiprocessing
    import time

    from meshnode.bench.cluster import LocalCluster
    from meshnode.paths import NodePaths

    paths = NodePaths.resolve(getattr(args, "home", None)).ensure()
    ref, source = _model(args, paths)
    print(f"meshnode bench flood: starting the victim ({ref.name}, {args.split} stage(s)) and the member ...",
          file=sys.stderr, flush=True)
    common = ("--no-discovery", "--threads", "1", "--parallel", "2", "--ctx", "512")
    with LocalCluster(ref.path, 2) as cluster:
        victim = cluster.start(0, *common, "--model", str(ref.path), "--split", str(args.split),
                               "--spec-mode", "off")
        member = cluster.start(1, *common, "--no-model", "--peer", f"127.0.0.1:{victim.info['quic_port']}")
        member_id = member.info["node_id"]
        victim.wait_model()
        deadline = time.monotonic() + 30
        while not _member_authenticated(victim, member_id):
            if time.monotonic() > deadline:
                raise BenchError(f"the member did not join the victim within 30 s:\n{victim.log_tail()}")
            time.sleep(0.1)
        model = victim.get("/v1/models")["data"][0]["id"]
        auth0, lost0 = _link_events(victim.log_path.read_text(errors="replace"), member_id)

        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        client = ctx.Process(target=_client, args=(child, victim.base_url, model, args.max_tokens), daemon=True)
        client.start()
        try:
            parent.send(("run", 1))   # warm-up: first-use costs are not the baseline's
            parent.recv()
            parent.send(("run", args.requests))
            base = parent.recv()
            parent.send(("loop", MAX_FLOOD_REQUESTS))
            res = asyncio.run(_flood(args, victim.info["quic_port"], victim.proc.pid))
            parent.send(("stop",))
            during = parent.recv()
            parent.send(("run", args.requests))   # after: was a slow spell the flood or this machine?
            after = parent.recv()
            parent.send(("quit",))
        finally:
            client.join(REQUEST_TIMEOUT_S + 5)
            if client.is_alive():
                client.kill()
        auth1, lost1 = _link_events(victim.log_path.read_text(errors="replace"), member_id)
        authenticated = _member_authenticated(victim, member_id)
        alive = victim.proc.poll() is None
    b, d, a = _Phase.of(base), _Phase.of(during), _Phase.of(after)
    answers = [r["text"] for r in base + during + after if r["ok"]]
    reference = answers[0] if answers else None
    identical = all(a == reference for a in answers)   # no answer at all: the failures say it
    res.update({
        "model": ref.name, "model_source": source, "split": args.split, "victim_alive": alive,
        # the existing keys: the member's link and the requests during the flood (chat completions)
        "link_unchanged": authenticated and auth1 == auth0 and lost1 == lost0,
        "peers": 1 if authenticated else 0,
        "requests_ok": d.ok, "requests_failed": b.failed + d.failed + a.failed, "worst_request_ms": d.max_ms,
        "serving": {
            "baseline": {"ok": b.ok, "failed": b.failed, "p50_ms": b.p50_ms, "max_ms": b.max_ms,
                         "errors": list(b.errors)},
            "flood": {"ok": d.ok, "failed": d.failed, "p50_ms": d.p50_ms, "max_ms": d.max_ms,
                      "errors": list(d.errors)},
            "after": {"ok": a.ok, "failed": a.failed, "p50_ms": a.p50_ms, "max_ms": a.max_ms,
                      "errors": list(a.errors)},
            "p50_ratio": _ratio(d.p50_ms, b.p50_ms), "max_ratio": _ratio(d.max_ms, b.max_ms),
            "answers_identical": identical, "answer": reference,
        },
    })
    return res


def verdict(res: dict, max_growth_mb: float) -> list[str]:
    """What went wrong in a run's results, one phrase each; empty when the node held."""
    out = []
    if res["rss_peak_growth_mb"] > max_growth_mb:
        out.append(f"memory grew {res['rss_peak_growth_mb']} MB > {max_growth_mb:g} MB")
    if res["requests_failed"]:
        out.append(f"{res['requests_failed']} request(s) failed")
    if not res["serving"]["answers_identical"]:
        out.append("a greedy answer changed")
    if not res["link_unchanged"]:
        out.append("the member's link was lost")
    if not res["victim_alive"]:
        out.append("the victim exited")
    return out


def run(args: argparse.Namespace) -> int:
    import json
    import logging

    from meshnode.errors import MeshnodeError

    if args.payload < 0:
        print("meshnode bench flood: --payload must be >= 0", file=sys.stderr)
        return 2
    logging.getLogger("quic").setLevel(logging.ERROR)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        res = _bench(args)
    except (MeshnodeError, RuntimeError, TimeoutError) as exc:
        print(f"meshnode bench flood: {exc}", file=sys.stderr)
        return 1
    srv = res["serving"]
    failures = verdict(res, args.max_growth_mb)
    res["failures"] = failures
    if args.json:
        print(json.dumps(res, indent=2))
        return 1 if failures else 0
    b, d, a = srv["baseline"], srv["flood"], srv["after"]
    print("meshnode bench flood: a non-member floods a node on loopback (own certificates, no secret)")
    print(f"  victim: a node process serving {res['model']} ({res['model_source']}) over its OpenAI endpoint, "
          + ("2 stages, the second on the member" if res["split"] == 2 else "alone, the member an idle peer"))
    print(f"  stranger: {res['connections']} connections ({args.parallel} at a time) x {args.streams} streams, "
          f"each a header declaring 64 MiB + {args.payload} B, in {res['flood_s']} s")
    print(f"  connected {res['connected']}, refused before QUIC {res['not_connected']}, closed by the node "
          f"{res['closed_by_node']} (lived median {res['lived_ms_median']} ms, max {res['lived_ms_max']} ms); "
          f"reasons: {', '.join(res['reasons'])}")
    print(f"  victim RSS {res['rss_before_mb']} MB before; peak growth {res['rss_peak_growth_mb']} MB, "
          f"{res['rss_growth_after_mb']} MB after (limit {args.max_growth_mb:g} MB)")
    over = "requests over it" if res["split"] == 2 else "chat completions"
    print(f"  member link: {'unchanged, authenticated' if res['link_unchanged'] else 'LOST'}; {over} "
          f"during the flood: {res['requests_ok']} ok, {res['requests_failed']} failed, worst "
          f"{res['worst_request_ms']} ms")
    print(f"  serving ({args.max_tokens} tokens, greedy, one request at a time, 127.0.0.1):")
    print(f"    before the flood: {b['ok']} ok, {b['failed']} failed, p50 {b['p50_ms']} ms, max {b['max_ms']} ms")
    print(f"    during the flood: {d['ok']} ok, {d['failed']} failed, p50 {d['p50_ms']} ms (x{srv['p50_ratio']}), "
          f"max {d['max_ms']} ms (x{srv['max_ratio']})")
    print(f"    after the flood:  {a['ok']} ok, {a['failed']} failed, p50 {a['p50_ms']} ms, max {a['max_ms']} ms")
    print(f"    greedy answer: {'identical in every request' if srv['answers_identical'] else 'CHANGED'} "
          f"({srv['answer']!r})")
    for e in (b["errors"] + d["errors"] + a["errors"])[:5]:
        print(f"  failed request: {e}")
    print("  verdict: " + ("FAILED (" + "; ".join(failures) + ")" if failures else "OK"))
    return 1 if failures else 0
