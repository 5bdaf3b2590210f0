"""`meshnode bench net`: decode-sized round trips and bulk throughput between two nodes
on loopback (two fabrics in one process, real QUIC + mesh auth, no mDNS).

Round trip: one Forward carrying one activation row of 576, 2048 and 4096 floats out on
a session data stream, a TokenReturn with one token (4 bytes of payload) back; the rows
marked "lane" make the same exchange on the fast lane (meshnode.net.lane) instead. Bulk: a
stream of Forward frames of ``--bulk-rows`` rows x 4096 floats, acknowledged at the end.
Both for f32 and f16 on the wire, for each QUIC datagram size asked (the first is the
baseline of the ratio column; 1350 B fits a 1500-byte LAN MTU, loopback allows more).
"""

from __future__ import annotations

import argparse
import sys

from meshnode.argtypes import non_negative_float, positive_int
from meshnode.bench.errors import BenchError

HELP = "QUIC round trip (decode-sized activations) and bulk throughput, f32 vs f16, on loopback"

WIDTHS = (576, 2048, 4096)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=positive_int, default=200, help="round trips per size (default 200)")
    parser.add_argument("--bulk-mb", type=non_negative_float, default=32.0, help="MB per bulk run (default 32)")
    parser.add_argument("--bulk-rows", type=positive_int, default=16, help="rows of 4096 floats per bulk frame (default 16)")
    parser.add_argument("--datagram-sizes", default="1350,16384",
                        help="comma-separated QUIC max datagram sizes (default 1350,16384)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import logging

    logging.getLogger("quic").setLevel(logging.WARNING)
    try:
        sizes = [int(x) for x in str(args.datagram_sizes).split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1200:
        print("meshnode bench net: --datagram-sizes takes comma-separated sizes in bytes, each "
              ">= 1200 (QUIC's minimum), e.g. 1350,16384", file=sys.stderr)
        return 2
    results = asyncio.run(_run_all(args, sizes))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print("meshnode bench net: two nodes in one process on loopback (real QUIC + TLS 1.3 + mesh auth)")
    base = results[0]
    for r in results:
        print(f"\nQUIC max datagram {r['datagram']} B" + ("" if r is base else f"  (ratios vs {base['datagram']} B)")
              + "; lane rows: ratio vs the same exchange over QUIC")
        print(f"  {'round trip':<24} {'median ms':>10} {'p90 ms':>8} {'ratio':>7}")
        for key, v in r["rtt"].items():
            ref = r["rtt"][key.removesuffix(" lane")] if key.endswith(" lane") else base["rtt"][key]
            ratio = v["median_ms"] / ref["median_ms"]
            print(f"  {key:<24} {v['median_ms']:>10.3f} {v['p90_ms']:>8.3f} {ratio:>6.2f}x")
        print(f"  {'bulk':<24} {'MB/s':>10} {'':>8} {'ratio':>7}")
        for key, v in r["bulk"].items():
            ratio = v / base["bulk"][key]
            print(f"  {key:<24} {v:>10.1f} {'':>8} {ratio:>6.2f}x")
    return 0


async def _run_all(args: argparse.Namespace, sizes: list[int]) -> list[dict]:
    out = []
    for size in sizes:
        out.append(await _run_one(args, size))
    return out


async def _run_one(args: argparse.Namespace, datagram: int) -> dict:
    import asyncio
    import tempfile
    import time
    from pathlib import Path

    import numpy as np

    from meshnode.mesh.fabric import MeshFabric
    from meshnode.net.identity import Identity
    from meshnode.net.link import LANE_MAX_FRAME, LinkSettings
    from meshnode.net.secret import new_secret
    from meshnode.paths import NodePaths
    from meshnode.wire import Forward, Segment, SegmentResult, TokenReturn, encode

    secret = new_secret()
    # Generous keep-alive: the benchmark saturates the loop; only the transport is measured.
    settings = LinkSettings(max_datagram_size=datagram, loopback_datagram_size=datagram,
                            idle_timeout_s=10.0, dead_after_s=10.0)
    with tempfile.TemporaryDirectory() as tmp:
        def mk(name: str, **kw) -> MeshFabric:
            p = NodePaths.resolve(Path(tmp) / name).ensure()
            return MeshFabric(p, Identity.generate(), secret, name=name, discovery=False,
                              settings=settings, bind_host="127.0.0.1", **kw)

        a = mk("a")
        await a.start()
        b = mk("b", static_peers=[f"127.0.0.1:{a.port}"])

        async def echo(node_id: str, msg) -> None:
            if isinstance(msg, Forward):
                res = SegmentResult(session=msg.segments[0].session, tokens=(1,), n_accepted=0, n_drafted=0)
                reply = TokenReturn(ref=msg.ref, batch_id=msg.batch_id, results=(res,))
                if msg.ref:
                    await b.send_data(node_id, reply, stream_key=("s", msg.segments[0].session))
                else:   # came on the fast lane: answer there
                    b.send_lane(node_id, reply)

        lane_reply: list[asyncio.Future] = []

        def on_a(node_id: str, msg) -> None:
            if isinstance(msg, TokenReturn) and lane_reply and not lane_reply[0].done():
                lane_reply[0].set_result(msg)

        b.on_message(echo)
        a.on_message(on_a)
        await b.start()
        for _ in range(500):
            if a.peers() and a.lane_ready(a.peers()[0].node_id) and b.peers() and b.lane_ready(a.node_id):
                break
            await asyncio.sleep(0.01)
        peer = a.peers()[0].node_id

        async def lane_round_trip(msg) -> None:
            lane_reply[:] = [asyncio.get_running_loop().create_future()]
            if not a.send_lane(peer, msg):
                raise BenchError("the fast lane is not up")
            await asyncio.wait_for(lane_reply[0], 5.0)

        def seg(rows: int) -> Segment:
            return Segment(session=1, pos=0, n_rows=rows, n_logits=0, drafts=(), temperature=0.0,
                           top_k=0, top_p=1.0, seed=0, flags=0)

        rtt: dict = {}
        for dtype in ("f32", "f16"):
            npd = np.float32 if dtype == "f32" else np.float16
            for width in WIDTHS:
                act = np.random.default_rng(0).standard_normal((1, width)).astype(npd)
                row = Forward(ref=0, batch_id=0, step=0, segments=(seg(1),), act=act)
                too_big = len(encode(row)) > LANE_MAX_FRAME
                for path in ("", " lane"):
                    if path and too_big:
                        continue   # such frames go over QUIC (PeerLink.send_lane)
                    times = []
                    for i in range(args.iters + 10):
                        msg = Forward(ref=0, batch_id=i, step=i, segments=(seg(1),), act=act)
                        t0 = time.perf_counter()
                        if path:
                            await lane_round_trip(msg)
                        else:
                            await a.request(peer, msg, timeout=5.0, data_stream=("s", 1))
                        if i >= 10:
                            times.append((time.perf_counter() - t0) * 1e3)
                    t = np.array(times)
                    rtt[f"{width} x {dtype}{path}"] = {"median_ms": float(np.median(t)),
                                                       "p90_ms": float(np.percentile(t, 90))}

        bulk: dict = {}
        for dtype in ("f32", "f16"):
            npd = np.float32 if dtype == "f32" else np.float16
            act = np.random.default_rng(1).standard_normal((args.bulk_rows, 4096)).astype(npd)
            n = max(1, int(args.bulk_mb * 1e6 / act.nbytes))
            t0 = time.perf_counter()
            for i in range(n - 1):
                await a.send_data(peer, Forward(ref=0, batch_id=i, step=i, segments=(seg(args.bulk_rows),), act=act),
                                  stream_key=("bulk", dtype))
                if i % 8 == 7:
                    await asyncio.sleep(0)  # let the loop transmit
            last = Forward(ref=0, batch_id=n, step=n, segments=(seg(args.bulk_rows),), act=act)
            await a.request(peer, last, timeout=120.0, data_stream=("bulk", dtype))
            dt = time.perf_counter() - t0
            bulk[f"4096-wide {dtype}"] = n * act.nbytes / dt / 1e6

        await b.stop()
        await a.stop()
    return {"datagram": datagram, "rtt": rtt, "bulk": bulk}
