"""`meshnode bench flood`: a non-member floods a node; does the node keep its memory, its
links and its answers? (issue #17)

A child process runs the victim: two fabrics of one mesh on loopback (the victim and a
member, real QUIC and mesh auth, no mDNS) with an authenticated link between them, and a
request loop over that link (a Status request every 50 ms, answered by the member). This
process is the stranger: with its own self-signed certificates and no secret
(:mod:`meshnode.net.flood`) it opens ``--connections`` QUIC connections to the victim,
``--parallel`` at a time, each opening ``--streams`` streams that carry a frame header
declaring the largest frame (64 MiB) and ``--payload`` bytes, for at most
``--duration`` seconds. It samples the victim's resident memory (``/proc/PID/status``)
every 50 ms and reports the growth, how long the stranger's connections lived (and how
many were refused outright), and whether the member's link and its requests kept
working. Loopback only; bounded in count and time. Exit status 1 when the memory grew by
more than ``--max-growth-mb`` or a request over the link failed.
"""

from __future__ import annotations

import argparse
import sys

from meshnode.argtypes import non_negative_float, positive_int

HELP = "flood a node from a non-member (connections, streams, max-size frames): memory growth, links, lifetimes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connections", type=positive_int, default=200, help="stranger connections in all (default 200)")
    parser.add_argument("--parallel", type=positive_int, default=20, help="connections at a time (default 20)")
    parser.add_argument("--streams", type=positive_int, default=20, help="streams per connection (default 20)")
    parser.add_argument("--payload", type=int, default=0, help="payload bytes after each header (default 0)")
    parser.add_argument("--duration", type=non_negative_float, default=20.0, help="stop flooding after this many s (default 20)")
    parser.add_argument("--max-growth-mb", type=non_negative_float, default=50.0,
                        help="fail (exit 1) when the victim grew by more (default 50)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _victim(conn) -> None:  # type: ignore[no-untyped-def]
    """The child: victim + member and the request loop; see the module docstring."""
    import asyncio
    import logging
    import tempfile
    import time
    from pathlib import Path

    from meshnode.mesh.fabric import MeshFabric
    from meshnode.net.secret import new_secret
    from meshnode.paths import NodePaths
    from meshnode.wire import StageStatus, Status

    logging.basicConfig(level=logging.WARNING, format="victim %(levelname)s %(name)s: %(message)s")
    logging.getLogger("quic").setLevel(logging.ERROR)

    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            s = new_secret()

            def mk(name: str, **kw) -> MeshFabric:  # type: ignore[no-untyped-def]
                return MeshFabric(NodePaths.resolve(Path(tmp) / name).ensure(), secret=s, name=name,
                                  discovery=False, bind_host="127.0.0.1", capabilities={"cores": 1}, **kw)

            a = mk("victim")
            await a.start()
            b = mk("member", static_peers=[f"127.0.0.1:{a.port}"])

            async def answer(node_id: str, msg) -> None:  # type: ignore[no-untyped-def]
                if isinstance(msg, Status):
                    await b.send(node_id, Status(ref=msg.ref, term=msg.term, state=StageStatus.STOPPED,
                                                 detail="", progress=1.0))

            b.on_message(answer)
            await b.start()
            while not (a.peers() and b.peers()):
                await asyncio.sleep(0.02)
            link = a._links[b.node_id]   # noqa: SLF001 (the bench checks it is the same link at the end)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            loop.add_reader(conn.fileno(), stop.set)
            conn.send(a.port)
            ok = failed = 0
            worst = 0.0
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    await a.request(b.node_id, Status(ref=0, term=ok, state=StageStatus.CLAIMED, detail="",
                                                      progress=0.0), timeout=2.0)
                    ok += 1
                    worst = max(worst, time.perf_counter() - t0)
                except Exception:
                    failed += 1
                await asyncio.sleep(0.05)
            loop.remove_reader(conn.fileno())
            conn.recv()
            same = a._links.get(b.node_id) is link and link.authenticated   # noqa: SLF001
            refused = a._server.admission.refused if a._server else 0   # noqa: SLF001
            conn.send({"requests_ok": ok, "requests_failed": failed, "worst_request_ms": round(worst * 1e3, 1),
                       "link_unchanged": same, "peers": len(a.peers()), "admission_refused": refused})
            await b.stop()
            await a.stop()

    asyncio.run(main())


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


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import logging
    import multiprocessing

    if args.payload < 0:
        print("meshnode bench flood: --payload must be >= 0", file=sys.stderr)
        return 2
    logging.getLogger("quic").setLevel(logging.ERROR)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_victim, args=(child,), daemon=True)
    proc.start()
    try:
        if not parent.poll(30):
            print("meshnode bench flood: the victim node did not come up within 30 s", file=sys.stderr)
            return 1
        port = parent.recv()
        res = asyncio.run(_flood(args, port, proc.pid))
        parent.send("stop")
        if not parent.poll(10):
            print("meshnode bench flood: the victim did not report", file=sys.stderr)
            return 1
        res.update(parent.recv())
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    good = res["rss_peak_growth_mb"] <= args.max_growth_mb and res["requests_failed"] == 0 and res["link_unchanged"]
    if args.json:
        print(json.dumps(res, indent=2))
        return 0 if good else 1
    print("meshnode bench flood: a non-member floods a node on loopback (own certificates, no secret)")
    print(f"  stranger: {res['connections']} connections ({args.parallel} at a time) x {args.streams} streams, "
          f"each a header declaring 64 MiB + {args.payload} B, in {res['flood_s']} s")
    print(f"  connected {res['connected']}, refused before QUIC {res['not_connected']}, closed by the node "
          f"{res['closed_by_node']} (lived median {res['lived_ms_median']} ms, max {res['lived_ms_max']} ms); "
          f"reasons: {', '.join(res['reasons'])}")
    print(f"  victim RSS {res['rss_before_mb']} MB before; peak growth {res['rss_peak_growth_mb']} MB, "
          f"{res['rss_growth_after_mb']} MB after (limit {args.max_growth_mb:g} MB)")
    print(f"  member link: {'unchanged, authenticated' if res['link_unchanged'] else 'LOST'}; requests over it "
          f"during the flood: {res['requests_ok']} ok, {res['requests_failed']} failed, worst "
          f"{res['worst_request_ms']} ms")
    print("  verdict: " + ("OK" if good else "FAILED"))
    return 0 if good else 1
