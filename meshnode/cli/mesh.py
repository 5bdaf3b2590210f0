"""`meshnode status`, `meshnode invite`, `meshnode join TOKEN`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from meshnode.cli import add_common_options
from meshnode.errors import MeshnodeError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show the running node of this home and its peers")
    add_common_options(p)
    p.add_argument("--json", action="store_true", help="print JSON (stable: {node, peers})")
    p.add_argument("--timeout", type=float, default=5.0, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("invite", help="print a token that lets another node join this mesh")
    add_common_options(p)
    p.set_defaults(func=cmd_invite)

    p = sub.add_parser("join", help="join the mesh of a token printed by `meshnode invite`")
    add_common_options(p)
    p.add_argument("token")
    p.set_defaults(func=cmd_join)


def _paths(args: argparse.Namespace):
    from meshnode.paths import NodePaths

    return NodePaths.resolve(args.home)


def fetch_status(paths, timeout: float = 5.0) -> dict:
    """GET /status of the node running for ``paths``; raises MeshnodeError when none."""
    import urllib.error
    import urllib.request

    try:
        info = json.loads(paths.runtime_file.read_text())
    except (FileNotFoundError, ValueError):
        raise MeshnodeError(f"no node is running for this home ({paths.state}); start one with `meshnode serve --headless`")
    pid = int(info.get("pid", 0))
    if pid:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise MeshnodeError(f"the node of this home (pid {pid}) is not running any more")
        except PermissionError:
            pass
    host = info.get("http_host") or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    url = f"http://{host}:{info['http_port']}/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise MeshnodeError(f"cannot reach the node at {url}: {exc}")


def cmd_status(args: argparse.Namespace) -> int:
    data = fetch_status(_paths(args), args.timeout)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    n = data["node"]
    print(f"node   {n['name']} ({n['node_id']})  mesh {n['mesh_id']}  {n['address']}  {n['http_url']}")
    print(f"       {_caps(n.get('capabilities'))}")
    model = data.get("model")
    stages = data.get("stages") or []
    if model or stages:
        print(f"model  {model or '-'}")
        for s in stages:
            a, b = s["layers"]
            detail = f"  ({s['detail']})" if s.get("detail") else ""
            print(f"       stage {s['index']}: layers [{a},{b}) on {s['node']}: {s['state']}{detail}")
    peers = data["peers"]
    if not peers:
        print("peers  none")
        return 0
    print(f"{'PEER':<16} {'ADDRESS':<22} {'RTT ms':>7} {'AUTH':<8} {'IN B/s':>9} {'OUT B/s':>9}  CAPABILITIES")
    for p in peers:
        rtt = f"{p['rtt_ms']:.2f}" if p.get("rtt_ms") is not None else "-"
        auth = ("yes+lane" if p.get("lane") else "yes") if p["authenticated"] else "no"   # lane: docs/mesh.md
        print(f"{p['name'][:16]:<16} {p['address']:<22} {rtt:>7} {auth:<8} "
              f"{p.get('bytes_per_s_in', 0):>9.0f} {p.get('bytes_per_s_out', 0):>9.0f}  {_caps(p.get('capabilities'))}")
    return 0


def _caps(c: dict | None) -> str:
    if not c:
        return "-"
    s = f"{c['backend']} {c['cores']} cores, {c['free_ram_bytes'] / 2**30:.1f} GiB free"
    if c.get("free_vram_bytes"):
        s += f", {c['free_vram_bytes'] / 2**30:.1f} GiB VRAM"
    if c.get("models"):
        s += ", models: " + ", ".join(f"{m['name']} ({m['n_layers']} layers)" for m in c["models"])
    return s


def cmd_invite(args: argparse.Namespace) -> int:
    from meshnode.net.secret import SecretStore, make_token, mesh_id

    paths = _paths(args).ensure()
    secret = SecretStore(paths).load_or_create()
    print(f"mesh {mesh_id(secret)}: on another machine run `meshnode join TOKEN` with this token:", file=sys.stderr)
    print(make_token(secret))
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    from meshnode.net.secret import SecretStore, mesh_id, parse_token

    secret = parse_token(args.token)  # InvalidTokenError -> exit code 2 with the reason
    paths = _paths(args).ensure()
    store = SecretStore(paths)
    old = store.load()
    if old == secret:
        print(f"already in mesh {mesh_id(secret)}")
        return 0
    where = store.save(secret)
    if old is not None:
        print(f"left mesh {mesh_id(old)}")
    print(f"joined mesh {mesh_id(secret)} (secret stored in {where}); restart a running node to use it")
    return 0
