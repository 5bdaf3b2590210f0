"""`meshnode run` (node + TUI, the default) and `meshnode serve --headless`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from meshnode.cli import add_common_options

log = logging.getLogger(__name__)


def _add_node_options(p: argparse.ArgumentParser) -> None:
    add_common_options(p)
    p.add_argument("--port", type=int, default=8642, metavar="N",
                   help="HTTP port of the OpenAI endpoint (default 8642; 0 = any free port)")
    p.add_argument("--quic-port", type=int, default=0, metavar="N",
                   help="UDP port for QUIC links to peers (default 0 = any)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the HTTP endpoint binds to (default 127.0.0.1)")
    p.add_argument("--interface", action="append", metavar="ADDR", default=None,
                   help="IPv4 address of an interface for mDNS discovery (repeatable; default all)")
    p.add_argument("--peer", action="append", metavar="HOST:PORT", default=[],
                   help="also dial this peer's QUIC endpoint directly (repeatable; for networks without mDNS)")
    p.add_argument("--name", default=None, help="this node's display name (default: host name)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="start this node and open the TUI (the default command)")
    _add_node_options(p)
    p.set_defaults(func=cmd_run, tui_logging=True)

    p = sub.add_parser("serve", help="run this node (with --headless: no TUI)")
    _add_node_options(p)
    p.add_argument("--headless", action="store_true", help="no TUI: log to stderr")
    p.set_defaults(func=cmd_serve)


def _node_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        port=args.quic_port, http_port=args.port, http_host=args.host,
        interfaces=args.interface, name=args.name, static_peers=args.peer,
    )


def cmd_run(args: argparse.Namespace) -> int:
    try:
        from ui.app import run_tui  # type: ignore[import-not-found]
    except ImportError:
        from meshnode.cli import setup_logging

        setup_logging(args.log_level)
        print("meshnode: the TUI is not available; running headless (Ctrl-C stops)", file=sys.stderr)
        return cmd_serve(args)
    from meshnode.node import Node
    from meshnode.paths import NodePaths

    logging.getLogger("quic").setLevel(logging.WARNING)
    paths = NodePaths.resolve(args.home)
    return int(run_tui(lambda: Node(paths, **_node_kwargs(args))) or 0)


def cmd_serve(args: argparse.Namespace) -> int:
    if not getattr(args, "headless", True):
        return cmd_run(args)
    logging.getLogger("quic").setLevel(logging.WARNING)
    return asyncio.run(serve_headless(args))


async def serve_headless(args: argparse.Namespace) -> int:
    from meshnode.node import Node
    from meshnode.paths import NodePaths

    node = Node(NodePaths.resolve(args.home), **_node_kwargs(args))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await node.start()
    print(f"meshnode: node {node.fabric.node_id} ({node.name}) serving {node.http_url}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        log.info("stopping")
        await node.stop()
    return 0
