"""`meshnode bench share`: model sharing between real node processes.

Three nodes (two holders, one puller with an empty store) pull through the puller's
``POST /mesh/pull`` (what ``meshnode models pull`` uses), end to end: the ticket over the
QUIC link, TLS over TCP, every chunk verified, the whole file hashed, renamed. Rows: the
whole model and the layer package of ``--range`` (the holders build it once, before the
timed runs, as they build the model's manifest; each timed pull of a whole model waits
for the puller's store to index it before the next), from one source and from two.
Baselines in the same run: a local file copy of the model (page cache to disk) on loopback; one raw TCP stream through the shaped link
between network namespaces (``tc tbf`` at ``--rate``, the puller's link). Last: the time
from ``meshnode serve --no-model`` on a fresh node to its stage being ready in a 2-stage
split (it fetches its package), beside the same with a node that holds the model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from meshnode.argtypes import positive_int
from meshnode.bench.errors import BenchError

HELP = ("model sharing: MB/s of pulls (whole model, layer package; one and two sources) on loopback and "
        "through a shaped 1 Gbit/s namespace link, beside a local file copy; time to a --no-model node's stage")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH|NAME",
                        help="the model to share (default: the default model, fetched on first use)")
    parser.add_argument("--runs", type=positive_int, default=3, help="timed pulls per row (default 3; the median is shown)")
    parser.add_argument("--range", dest="layer_range", default=None, metavar="A:B",
                        help="the layer package's blocks (default: the middle third)")
    parser.add_argument("--rate", default="1gbit", help="tc rate of the shaped link (default 1gbit)")
    parser.add_argument("--no-netns", action="store_true", help="skip the shaped-link part")
    parser.add_argument("--no-stage", action="store_true", help="skip the time-to-stage part")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("MESHNODE_KEYRING", "file")
    env.pop("MESHNODE_HOME", None)
    return env


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshnode", *args], env=_env(), capture_output=True,
                          text=True, timeout=60)


def _homes(root: Path, model: Path, n: int, holders: int) -> list[Path]:
    from meshnode.bench.cluster import link_model

    homes = [root / f"node{i}" for i in range(n)]
    for i, h in enumerate(homes):
        h.mkdir(parents=True, exist_ok=True)
        if i < holders:
            link_model(h, model)
    token = _cli("invite", "--home", str(homes[0])).stdout.strip().splitlines()[-1]
    for h in homes[1:]:
        r = _cli("join", token, "--home", str(h))
        if r.returncode != 0:
            raise BenchError(f"join failed: {r.stderr}")
    return homes


class _Node:
    """A node process; ``enter``: a context manager putting the caller in its namespace."""

    def __init__(self, home: Path, proc: subprocess.Popen, enter=None) -> None:
        self.home, self.proc, self.enter = home, proc, enter
        self.port = 0

    def _ctx(self):
        import contextlib

        return self.enter() if self.enter is not None else contextlib.nullcontext()

    def open(self, route: str, body: dict | None = None, timeout: float = 10.0):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{route}", data=data,
                                     headers={"Content-Type": "application/json"})
        with self._ctx():
            return urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=timeout)

    def get(self, route: str) -> dict:
        with self.open(route) as r:
            return json.loads(r.read())

    def wait_up(self, timeout: float = 60.0) -> "_Node":
        rt = self.home / "state" / "node.json"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"node {self.home.name} exited:\n{(self.home / 'node.log').read_text()[-3000:]}")
            try:
                self.port = json.loads(rt.read_text())["http_port"]
                self.get("/health")
                return self
            except (OSError, ValueError, KeyError):
                time.sleep(0.05)
        raise TimeoutError(f"node {self.home.name} did not come up")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start(home: Path, name: str, *flags: str, net=None, index: int = 0) -> _Node:
    iface = net.ip(index) if net is not None else "127.0.0.1"
    argv = [sys.executable, "-m", "meshnode", "serve", "--headless", "--home", str(home), "--port", "0",
            "--interface", iface, "--name", name, "--threads", "1", *flags]
    with open(home / "node.log", "ab") as log:
        if net is None:
            proc = subprocess.Popen(argv, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        else:
            proc = net.popen(index, argv, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    return _Node(home, proc, (lambda: net.inside(index)) if net is not None else None).wait_up()


def _wait_holders(puller: _Node, n: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        models = puller.get("/mesh/models")["models"]
        if models and len(models[0]["holders"]) >= n:
            return models[0]
        time.sleep(0.2)
    raise TimeoutError(f"the puller does not see {n} holders")


def _pull(puller: _Node, body: dict) -> tuple[float, Path]:
    t0 = time.perf_counter()
    with puller.open("/mesh/pull", body, timeout=600) as r:
        for line in r:
            item = json.loads(line)
            if "error" in item:
                raise BenchError(f"pull failed: {item['error']}")
            if "path" in item:
                return time.perf_counter() - t0, Path(item["path"])
    raise BenchError("pull ended without a result")


def _pull_rows(puller: _Node, entry: dict, holders: list[str], rng: tuple[int, int], runs: int) -> list[dict]:
    rows = []
    body0 = {"model": entry["sha256"]}
    cases = [("whole model", {}, None), ("layer package", {"layers": list(rng)}, None)]
    # before the timed runs the holders slice the package and hash the model's chunks for
    # its manifest, once each (Prepare's and the first offer's cost, not the transfer's)
    for warm_body in ({**body0, "layers": list(rng)}, body0):
        _, warm = _pull(puller, warm_body)
        _settle(warm)
        _remove(warm)
    for label, extra, _ in cases:
        for nsrc in (1, 2):
            body = {**body0, **extra, **({"from": holders[0]} if nsrc == 1 else {})}
            secs, size = [], 0
            for _ in range(runs):
                dt, path = _pull(puller, body)
                _settle(path)
                size = path.stat().st_size
                secs.append(dt)
                _remove(path)
            rows.append({"what": label, "sources": nsrc, "bytes": size, "s": statistics.median(secs),
                         "mb_s": size / statistics.median(secs) / 1e6})
    return rows


def _settle(path: Path, timeout: float = 300.0) -> None:
    """Wait until the puller's store has indexed a whole model it pulled (its record is
    written beside it after the pull answered): that GGUF parse is the store's, not the
    transfer's, and must not run during the next timed pull."""
    from meshnode.models.index import record_path

    if path.parent.name != "models":
        return
    deadline = time.monotonic() + timeout
    while not record_path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _remove(path: Path) -> None:
    for p in (path, path.with_suffix(".json"), path.with_name(path.name + ".meshnode.json")):
        p.unlink(missing_ok=True)
    for p in path.parent.glob(path.name + "*"):
        p.unlink(missing_ok=True)


def _copy_rate(model: Path, root: Path) -> float:
    dest = root / "copy.gguf"
    t0 = time.perf_counter()
    shutil.copyfile(model, dest)
    with open(dest, "rb+") as f:
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    dest.unlink()
    return model.stat().st_size / dt / 1e6


def _mid(n_layers: int) -> tuple[int, int]:
    return n_layers // 3, 2 * n_layers // 3


def _loopback(model: Path, rng, runs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="meshnode-bench-share-") as tmp:
        root = Path(tmp)
        homes = _homes(root, model, 3, holders=2)
        nodes = []
        try:
            nodes = [_start(h, f"node{i}", "--no-model") for i, h in enumerate(homes)]
            entry = _wait_holders(nodes[2], 2)
            rng = rng or _mid(entry["n_layers"])
            copy = _copy_rate(model, root)
            rows = _pull_rows(nodes[2], entry, [nodes[0].get("/health")["node_id"]], rng, runs)
        finally:
            for n in nodes:
                n.stop()
    return {"copy_mb_s": copy, "rows": rows, "range": list(rng)}


def _shaped(model: Path, rng, runs: int, rate: str) -> dict:
    from meshnode.bench.netns import Netns

    with tempfile.TemporaryDirectory(prefix="meshnode-bench-share-") as tmp, Netns(3) as net:
        root = Path(tmp)
        homes = _homes(root, model, 3, holders=2)
        nodes = []
        try:
            nodes = [_start(h, f"node{i}", "--no-model", net=net, index=i) for i, h in enumerate(homes)]
            entry = _wait_holders(nodes[2], 2)
            rng = rng or _mid(entry["n_layers"])
            net.shape(2, rate)
            line = net.tcp_rate(0, 2, 200_000_000) / 8 / 1e6
            rows = _pull_rows(nodes[2], entry, [nodes[0].get("/health")["node_id"]], rng, runs)
        finally:
            for n in nodes:
                n.stop()
    return {"tcp_mb_s": line, "rows": rows, "rate": rate}


def _time_to_stage(model: Path) -> dict:
    out = {}
    for label, holds in (("holder", True), ("--no-model, empty store", False)):
        with tempfile.TemporaryDirectory(prefix="meshnode-bench-share-") as tmp:
            root = Path(tmp)
            homes = _homes(root, model, 2, holders=2 if holds else 1)
            nodes = []
            try:
                t0 = time.perf_counter()
                nodes.append(_start(homes[1], "fresh", "--no-model"))
                nodes.append(_start(homes[0], "coord", "--model", str(model), "--split", "2", "--ctx", "512"))
                deadline = time.monotonic() + 600
                while (state := nodes[1].get("/health").get("model") or {}).get("state") != "ready":
                    if state.get("state") == "failed":
                        raise BenchError(f"the split failed: {state.get('detail')}")
                    if time.monotonic() > deadline:
                        raise TimeoutError("the split did not get ready")
                    time.sleep(0.1)
                out[label] = time.perf_counter() - t0
            finally:
                for n in reversed(nodes):
                    n.stop()
    return out


def run(args: argparse.Namespace) -> int:
    from meshnode.bench.netns import unavailable
    from meshnode.models.store import resolve_model
    from meshnode.paths import NodePaths

    ref = resolve_model(args.model, NodePaths.resolve(getattr(args, "home", None)))
    try:
        rng = tuple(int(x) for x in args.layer_range.split(":")) if args.layer_range else None
        if rng is not None and (len(rng) != 2 or not 0 <= rng[0] < rng[1]):
            raise ValueError
    except ValueError:
        print(f"meshnode bench share: --range takes A:B with 0 <= A < B, got {args.layer_range!r}", file=sys.stderr)
        return 2
    res: dict = {"model": ref.name, "size": ref.path.stat().st_size}
    res["loopback"] = _loopback(ref.path, rng, args.runs)
    why = "--no-netns" if args.no_netns else unavailable()
    res["shaped"] = None if why else _shaped(ref.path, rng, args.runs, args.rate)
    res["shaped_skipped"] = why
    res["stage_ready_s"] = None if args.no_stage else _time_to_stage(ref.path)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    lb = res["loopback"]
    print(f"meshnode bench share: {ref.name} ({res['size'] / 1e6:.0f} MB), three node processes, "
          f"layer package [{lb['range'][0]}, {lb['range'][1]}), median of {args.runs}")
    print(f"\nloopback (baseline: local file copy {lb['copy_mb_s']:.0f} MB/s)")
    _table(lb["rows"], lb["copy_mb_s"], "vs copy")
    if res["shaped"]:
        sh = res["shaped"]
        print(f"\nshaped link, tc tbf {sh['rate']} between namespaces (baseline: one raw TCP stream "
              f"{sh['tcp_mb_s']:.0f} MB/s)")
        _table(sh["rows"], sh["tcp_mb_s"], "vs TCP")
    else:
        print(f"\nshaped link: skipped ({why})")
    if res["stage_ready_s"]:
        print("\ntime from `serve --no-model` on a fresh node to a 2-stage split being ready")
        base = res["stage_ready_s"]["holder"]
        for k, v in res["stage_ready_s"].items():
            print(f"  {k:<28} {v:7.1f} s  {v / base:5.2f}x")
    return 0


def _table(rows: list[dict], base: float, what: str) -> None:
    print(f"  {'pull':<16} {'sources':>7} {'MB':>7} {'s':>7} {'MB/s':>8} {what:>8}")
    for r in rows:
        print(f"  {r['what']:<16} {r['sources']:>7} {r['bytes'] / 1e6:>7.1f} {r['s']:>7.2f} "
              f"{r['mb_s']:>8.0f} {r['mb_s'] / base:>7.2f}x")
