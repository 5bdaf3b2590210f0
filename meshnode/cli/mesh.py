"""`meshnode status`, `meshnode invite`, `meshnode join [TOKEN]`, `meshnode mesh rotate`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from meshnode.argtypes import positive_float
from meshnode.cli import add_common_options
from meshnode.errors import MeshnodeError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show the running node of this home and its peers")
    add_common_options(p)
    p.add_argument("--json", action="store_true", help="print JSON (stable: {node, peers})")
    p.add_argument("--timeout", type=positive_float, default=5.0, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("invite", help="print a token that lets another node join this mesh")
    add_common_options(p)
    p.set_defaults(func=cmd_invite)

    p = sub.add_parser("join", help="join the mesh of a token printed by `meshnode invite` "
                       "(asks for it; a token on the command line stays in shell history)")
    add_common_options(p)
    p.add_argument("token", nargs="?", default="-",
                   help="the token; omitted or '-': read from a prompt (no echo) or stdin")
    p.set_defaults(func=cmd_join)

    p = sub.add_parser("mesh", help="manage the mesh secret")
    add_common_options(p)
    msub = p.add_subparsers(dest="mesh_command", metavar="ACTION", required=True)
    r = msub.add_parser("rotate", help="replace a leaked mesh secret on the members that are online "
                        "and print the token the others must join again with")
    add_common_options(r)
    r.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                   help="also reach the member at HOST:PORT (repeatable; default: this home's "
                   "running node and its peers)")
    r.add_argument("--exclude", action="append", default=[], metavar="NODE_ID",
                   help="do not give the new secret to this member (a compromised one; repeatable)")
    r.add_argument("--timeout", type=positive_float, default=5.0, help="seconds to reach the members (default 5)")
    r.set_defaults(func=cmd_rotate)


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
        # The node is on this machine: never through an HTTP proxy from the environment.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise MeshnodeError(f"cannot reach the node at {url}: {exc}")


def cmd_status(args: argparse.Namespace) -> int:
    from meshnode.state import compute_label, format_step_costs, node_labels, printable as pr   # names and details come from other machines

    data = fetch_status(_paths(args), args.timeout)
    if args.json:
        print(json.dumps(data, indent=2))   # JSON escapes control characters itself
        return 0
    n = data["node"]
    stages = data.get("stages") or []
    nodes = [(n["node_id"], n["name"]), *((p["node_id"], p["name"]) for p in data["peers"]),
             *((s["node_id"], s["node"]) for s in stages)]
    labels, short = node_labels(nodes), node_labels(nodes, width=16)
    print(f"node   {pr(n['name'])} ({pr(n['node_id'])})  mesh {pr(n['mesh_id'])}  {pr(n['address'])}  {pr(n['http_url'])}")
    print(f"       {_caps(n.get('capabilities'))}")
    model = data.get("model")
    state = str(data.get("status") or "")
    if model or stages:
        print(f"model  {pr(model or '-')}")
    elif state not in ("", "ready", "no model"):   # e.g. fetching a model before it is known
        print(f"model  {pr(state)}: {pr(data.get('status_detail') or '')}")
    for s in stages:
        a, b = s["layers"]
        detail = f"  ({pr(s['detail'])})" if s.get("detail") else ""
        compute = compute_label(str(s.get("backend") or ""), int(s.get("threads") or 0), int(s.get("max_threads") or 0))
        on = f" ({pr(compute)})" if compute else ""
        print(f"       stage {s['index']}: layers [{a},{b}) on {labels[s['node_id']]}{on}: {pr(s['state'])}{detail}")
    for t in data.get("progress") or []:            # a fetch, a slice, a pull under way
        total, done = int(t.get("total_bytes") or 0), int(t.get("done_bytes") or 0)
        pct = f" ({100 * done / total:.0f}%)" if total else ""
        print(f"       {pr(t.get('what'), 32)} {pr(t.get('name'), 128)}: {done / 1e6:.1f} of "
              f"{total / 1e6:.1f} MB{pct}")
    for sp in data.get("spec") or []:   # docs/speculative.md, "Telemetry"
        if sp.get("strategy") in (None, "none"):
            continue
        print(f"       speculation {pr(sp['strategy'])} ({pr(sp['state'])}): {sp['accepted']} of "
              f"{sp['proposed']} drafts accepted in {sp['windows']} windows; step cost by drafts "
              f"{format_step_costs(sp.get('step_ms') or ())}, acceptance estimate "
              f"{100 * sp.get('acceptance_estimate', 0):.0f}%")
    pc = data.get("prefix_cache")
    if pc and pc.get("capacity"):   # docs/api.md, "Prefix reuse"
        print(f"       prefix reuse: {pc['sessions']}/{pc['capacity']} sessions kept, {pc['hits']} hits "
              f"of {pc['lookups']} requests, {pc['tokens_reused']} prompt tokens not prefilled"
              + (f" (whole chunks of {pc['align']}: a GPU stage)" if pc.get("align", 1) > 1 else ""))
    served = data.get("mesh_models") or []
    if served:   # every model ready in the mesh: this node's endpoint takes requests for each
        print("mesh models (any node's /v1 serves them)")
        for m in served:
            where = "this node" if m.get("local") else f"{pr(m['coordinator_name'], 64) or '?'} ({pr(m['coordinator_id'], 16)})"
            ctx = f"context {m['n_ctx']}" if m.get("n_ctx") else "context ?"
            print(f"       {pr(m['name'], 128)}  coordinated by {where}, {ctx}")
    peers = data["peers"]
    if not peers:
        print("peers  none")
        return 0
    print(f"{'PEER':<16} {'ADDRESS':<22} {'RTT ms':>7} {'AUTH':<8} {'IN B/s':>9} {'OUT B/s':>9}  CAPABILITIES")
    for p in peers:
        rtt = f"{p['rtt_ms']:.2f}" if p.get("rtt_ms") is not None else "-"
        auth = ("yes+lane" if p.get("lane") else "yes") if p["authenticated"] else "no"   # lane: docs/mesh.md
        print(f"{short[p['node_id']]:<16} {pr(p['address'], 22):<22} {rtt:>7} {auth:<8} "
              f"{p.get('bytes_per_s_in', 0):>9.0f} {p.get('bytes_per_s_out', 0):>9.0f}  {_caps(p.get('capabilities'))}")
    return 0


def _caps(c: dict | None) -> str:
    from meshnode.state import printable

    if not c:
        return "-"
    return printable(_caps_text(c), 1000)


def _caps_text(c: dict) -> str:
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
    print(f"mesh {mesh_id(secret)}: on another machine run `meshnode join` and paste this token at its prompt:", file=sys.stderr)
    print(make_token(secret))
    return 0


def read_token(arg: str | None) -> str:
    """The join token: ``arg`` unless it is None or ``-``, else a no-echo prompt on a
    terminal or one line of stdin (so it stays out of shell history and ``ps``)."""
    import getpass

    if arg not in (None, "-"):
        print("meshnode: note: a token on the command line stays in shell history and is visible "
              "to other users in the process list; `meshnode join` without it asks for it", file=sys.stderr)
        return arg
    if sys.stdin.isatty():
        return getpass.getpass("join token (input hidden): ")
    return sys.stdin.readline(4096)


def cmd_join(args: argparse.Namespace) -> int:
    from meshnode.net.secret import SecretStore, mesh_id, parse_token

    secret = parse_token(read_token(args.token))  # InvalidTokenError -> exit code 2 with the reason
    paths = _paths(args).ensure()
    store = SecretStore(paths)
    try:
        old = store.load()
    except MeshnodeError as exc:   # a damaged or unsafe secret file is replaced by the new one
        print(f"meshnode: replacing the stored secret: {exc}", file=sys.stderr)
        old = None
    if old == secret:
        print(f"already in mesh {mesh_id(secret)}")
        return 0
    where = store.save(secret)
    if old is not None:
        print(f"left mesh {mesh_id(old)}")
    print(f"joined mesh {mesh_id(secret)} (secret stored in {where}); restart a running node to use it")
    return 0


def _rotate_targets(paths, extra: list[str]) -> list[str]:
    """HOST:PORT of this home's running node and its peers, plus ``extra``."""
    targets: list[str] = []
    try:
        data = fetch_status(paths)
    except MeshnodeError as exc:
        print(f"meshnode: {exc}: reaching only --peer addresses", file=sys.stderr)
    else:
        port = str(data["node"]["address"]).rpartition(":")[2]
        targets.append(f"127.0.0.1:{port}")
        targets += [str(p["address"]) for p in data.get("peers", []) if p.get("authenticated")]
    return list(dict.fromkeys(targets + extra))


async def rotate_mesh(paths, old: bytes, new: bytes, targets: list[str], *, exclude: set[str] = frozenset(),
                      timeout: float = 5.0) -> tuple[dict[str, str], dict[str, str]]:
    """Give ``new`` to every member reachable at ``targets`` with the ``old`` secret.

    The tool joins the mesh for a moment as a member of its own (a fresh identity, so it
    never collides with this home's running node), sends ``SecretRotate`` over each
    authenticated link and waits for ``SecretAck``. Returns ({node id: name} of the members
    that stored it, {node id or address: why} of those that did not)."""
    import asyncio

    from meshnode.mesh.fabric import MeshFabric, PeerReplyError, PeerUnavailableError
    from meshnode.net.identity import Identity
    from meshnode.wire import SecretAck, SecretRotate

    fabric = MeshFabric(paths, identity=Identity.generate(), secret=old, name="meshnode-rotate",
                        capabilities={}, static_peers=targets, discovery=False)
    done: dict[str, str] = {}
    failed: dict[str, str] = {}
    await fabric.start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline and len(fabric.peers()) < len(targets):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)   # dials still finishing (a target may be one we already reached)

        async def one(node_id: str, name: str) -> None:
            try:
                reply = await fabric.request(node_id, SecretRotate(ref=0, secret=new), timeout=timeout)
            except (PeerReplyError, PeerUnavailableError, asyncio.TimeoutError) as exc:
                failed[node_id] = str(exc) or "no answer"
                return
            if isinstance(reply, SecretAck) and reply.mesh_id:
                done[node_id] = name
            else:
                failed[node_id] = f"unexpected answer {type(reply).__name__}"

        peers = [p for p in fabric.peers() if p.node_id not in exclude]
        await asyncio.gather(*(one(p.node_id, p.name) for p in peers))
        reached = {p.address for p in fabric.peers()}
        for t in targets:
            if t not in reached and not t.startswith("127.0.0.1:"):
                failed.setdefault(t, "not reached")
    finally:
        await fabric.stop()
    return done, failed


def cmd_rotate(args: argparse.Namespace) -> int:
    import asyncio

    from meshnode.net.secret import SecretStore, make_token, mesh_id, new_secret

    paths = _paths(args).ensure()
    store = SecretStore(paths)
    old = store.load()
    if old is None:
        raise MeshnodeError("this home holds no mesh secret: nothing to rotate")
    new = new_secret()
    targets = _rotate_targets(paths, args.peer)
    done, failed = asyncio.run(rotate_mesh(paths, old, new, targets, exclude=set(args.exclude),
                                           timeout=args.timeout))
    store.save(new)   # this home (its running node stored it too, when it was reached)
    out = sys.stderr
    print(f"mesh {mesh_id(old)} replaced by mesh {mesh_id(new)}", file=out)
    for node_id, name in sorted(done.items(), key=lambda kv: kv[1]):
        print(f"  stored on {name or node_id} ({node_id})", file=out)
    for who, why in sorted(failed.items()):
        print(f"  NOT stored on {who}: {why}", file=out)
    print("Links already up stay up until they drop; every new link needs the new secret.\n"
          "On each member that was offline, not reached or excluded and that should stay, run\n"
          "`meshnode join` and paste this token (then restart its node):", file=out)
    print(make_token(new))
    return 1 if failed else 0
