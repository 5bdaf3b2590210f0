"""`meshnode run` (node + TUI, the default) and `meshnode serve --headless`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from meshnode.argtypes import (
    GPU_LAYERS_HELP,
    cpu_list,
    cpu_ranges,
    draft_window,
    gpu_layers,
    non_negative_float,
    non_negative_int,
    parallel_requests,
    port,
    positive_int,
    size,
)
from meshnode.cli import add_common_options
from meshnode.config import MAX_SHUTDOWN_GRACE

log = logging.getLogger(__name__)


def _grace(text: str) -> float:
    v = non_negative_float(text)
    if v > MAX_SHUTDOWN_GRACE:
        raise argparse.ArgumentTypeError(f"at most {MAX_SHUTDOWN_GRACE:g} seconds, got {text}")
    return v


def _add_node_options(p: argparse.ArgumentParser) -> None:
    add_common_options(p)
    p.add_argument("--port", type=port, default=None, metavar="N",
                   help="HTTP port of the OpenAI endpoint (default 8642, or [node] http_port; 0 = any free port)")
    p.add_argument("--quic-port", type=port, default=None, metavar="N",
                   help="UDP port for QUIC links to peers (default 0 = any)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the HTTP endpoint binds to (default 127.0.0.1)")
    p.add_argument("--interface", action="append", metavar="ADDR", default=None,
                   help="IPv4 address of an interface for mDNS discovery (repeatable; default all)")
    p.add_argument("--peer", action="append", metavar="HOST:PORT", default=[],
                   help="also dial this peer's QUIC endpoint directly (repeatable; for networks without mDNS)")
    p.add_argument("--no-discovery", action="store_true",
                   help="no mDNS: reach peers only through --peer (networks without multicast)")
    p.add_argument("--no-share", action="store_true",
                   help="do not list or serve this node's models to members (they cannot pull from it)")
    p.add_argument("--name", default=None, help="this node's display name (default: host name)")
    p.add_argument("--shutdown-grace", type=_grace, default=None, metavar="SECONDS",
                   help="at SIGINT/SIGTERM (or q in the TUI), how long requests in flight may "
                        "still run before they are ended with an error; a second signal exits at "
                        "once (default 3, or [node] shutdown_grace)")

    h = p.add_argument_group("endpoint security (docs/api.md, Security)")
    h.add_argument("--api-key", default=None, metavar="KEY",
                   help="clients must send 'Authorization: Bearer KEY'; required with a --host off "
                        "loopback (also $MESHNODE_API_KEY or [http] api_key, which keep it out of ps)")
    h.add_argument("--allow-host", action="append", default=None, metavar="NAME",
                   help="another Host name the endpoint answers to, e.g. laptop.local (repeatable; "
                        "loopback names and IP addresses always work; * = any)")
    h.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="let web pages of ORIGIN (e.g. http://localhost:3000) call the API "
                        "(repeatable; default: none)")
    h.add_argument("--max-body", type=size, default=None, metavar="SIZE",
                   help="largest request body (default 4MiB)")
    h.add_argument("--max-queue", type=non_negative_int, default=None, metavar="N",
                   help="requests waiting beyond --parallel; more are answered 429 (default 16)")
    h.add_argument("--keep-responses", choices=("disk", "memory"), default=None,
                   help="where the Responses API's kept answers live (previous_response_id, GET "
                        "/v1/responses/ID): disk, so a restarted node continues them, or memory "
                        "(default disk, or [http] keep_responses)")

    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, metavar="MODEL",
                   help="GGUF path or store name to coordinate (default: SmolLM2-135M-Instruct, "
                        "fetched on first run), or a URL fetched into the store on first run: "
                        "https://.../FILE.gguf, hf:OWNER/REPO[:QUANT] or hf:OWNER/REPO[@REVISION]/FILE.gguf")
    m.add_argument("--no-model", action="store_true",
                   help="coordinate no model: only lend this node's memory to peers' models")
    m.add_argument("--alias", action="append", default=[], metavar="NAME",
                   help="another model name the endpoint accepts for this model (repeatable)")
    m.add_argument("--split", type=positive_int, default=None, metavar="N",
                   help="force N stages over the available peers")
    m.add_argument("--stages", default=None, metavar="NODE=A:B,...",
                   help="explicit plan: layer ranges per node name or id, e.g. me=0:15,laptop2=15:30")
    m.add_argument("--max-memory", type=size, default=None, metavar="SIZE",
                   help="memory this node may use for models, e.g. 6GB (default: free RAM)")
    m.add_argument("--ctx", type=positive_int, default=2048, metavar="N",
                   help="context size per request in tokens (default 2048)")
    m.add_argument("--batch", type=positive_int, default=64, metavar="N",
                   help="prefill chunk in tokens, the same on every stage (default 64)")
    m.add_argument("--parallel", type=parallel_requests, default=4, metavar="N",
                   help="requests served at once (default 4, at most 256: llama.cpp's sequences)")
    m.add_argument("--prefix-cache", type=non_negative_int, default=None, metavar="N",
                   help="keep up to N finished requests' KV so a prompt that begins with an "
                        "earlier one's tokens prefills only the rest (at most --parallel - 1, or 1 with --parallel 1, "
                        "the default; 0 = off; or [node] prefix_cache)")
    m.add_argument("--wire-dtype", choices=["f32", "f16"], default="f32",
                   help="hidden states on the wire: f32 (exact, default) or f16 (half the bytes)")
    m.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="llama.cpp threads per stage, at most (default: all cores; 1 for a stage wholly on "
                        "the GPU). A CPU stage computes with fewer while other programs keep cores busy "
                        "(MESHNODE_ADAPT_THREADS=0: always N)")
    m.add_argument("--decode-threads", type=positive_int, default=None, metavar="N",
                   help="llama.cpp threads for one-token steps (default: --threads). 1 makes "
                        "greedy output bit-identical with and without speculation, and across "
                        "nodes with different core counts, at long contexts; slower plain "
                        "decoding (set it on every node of a split)")
    m.add_argument("--cpus", type=cpu_list, default=None, metavar="LIST",
                   help="run this node on these CPUs only, e.g. 0 or 2-3 (Linux; default: any). "
                        "For several nodes on one machine: a stage that keeps its own cores "
                        "computes faster than one the scheduler moves around")
    m.add_argument("--gpu-layers", type=gpu_layers, default=-1, metavar="N|all|auto",
                   help=GPU_LAYERS_HELP + "; it applies to this node's own stage and to the "
                        "stages it serves for peers")
    m.add_argument("--busy-poll", action=argparse.BooleanOptionalAction, default=None,
                   help="while tokens flow, wait for the network on a spinning CPU core instead "
                        "of sleeping: each hop of a split's token path ~40-60 us shorter, for a "
                        "core kept busy (docs/mesh.md, Busy polling; default off, or [node] busy_poll)")

    s = p.add_argument_group("speculative decoding (flags override config.toml and the model package)")
    s.add_argument("--spec", dest="spec_strategy", default=None, metavar="STRATEGY",
                   help="strategy: ngram, draft-model, none, or a name from model-package.json")
    s.add_argument("--spec-mode", choices=["auto", "on", "off"], default=None,
                   help="auto (speculation turns itself on where it pays, off where it does not; "
                        "the default), on, or off")
    s.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="draft GGUF (must share the target's vocabulary); implies --spec draft-model")
    s.add_argument("--no-draft", action="store_true",
                   help="ignore a draft model declared by the model package or config")
    s.add_argument("--draft-policy", choices=["adaptive", "fixed"], default=None,
                   help="window policy (default adaptive)")
    s.add_argument("--draft-initial", type=draft_window, default=None, metavar="N", help="initial window (1-32)")
    s.add_argument("--draft-min", type=draft_window, default=None, metavar="N", help="smallest window (1-32)")
    s.add_argument("--draft-max", type=draft_window, default=None, metavar="N", help="largest window (1-32)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="start this node and open the TUI (the default command)")
    _add_node_options(p)
    p.set_defaults(func=cmd_run, tui_logging=True)

    p = sub.add_parser("serve", help="run this node (with --headless: no TUI)")
    _add_node_options(p)
    p.add_argument("--headless", action="store_true", help="no TUI: log to stderr")
    p.set_defaults(func=cmd_serve)


def _first(*values):
    """The first value that is set (0 counts: it means "any free port")."""
    return next(v for v in values if v is not None)


def _check_model_options(args: argparse.Namespace) -> None:
    """Catch mistakes in flags before anything starts (the rest is checked while loading)."""
    from pathlib import Path

    from meshnode.errors import MeshnodeError
    from meshnode.mesh.planner import parse_explicit
    from meshnode.models.url_fetch import is_model_url   # (checks a URL's form: fetched as the node starts)

    if args.no_model and (args.model or args.split or args.stages):
        raise MeshnodeError("--no-model cannot be combined with --model, --split or --stages")
    if args.split and args.stages:
        raise MeshnodeError("give either --split or --stages, not both")
    if args.stages:
        parse_explicit(args.stages)  # raises PlanError with what is wrong
    if args.model and not is_model_url(args.model) and (args.model.endswith(".gguf") or "/" in args.model):
        _check_model_file(Path(args.model).expanduser())
    if args.draft_model and args.no_draft:
        raise MeshnodeError("--draft-model and --no-draft contradict each other")
    if args.draft_min is not None and args.draft_max is not None and args.draft_min > args.draft_max:
        raise MeshnodeError(f"--draft-min {args.draft_min} is larger than --draft-max {args.draft_max}")


def _check_model_file(path) -> None:
    """A model given as a path: there, and a GGUF whose summary reads (a file that is not
    one is the user's mistake, named before the node starts, not a node left without a
    model). Raises MeshnodeError."""
    from meshnode.models.gguf_info import read_model_info

    read_model_info(path)


def _node_kwargs(args: argparse.Namespace, paths, config=None) -> dict:
    """Node arguments from CLI flags over config.toml (``config``, read from ``paths``
    when None; reading it logs its warnings) over defaults. Raises MeshnodeError."""
    from meshnode.config import load_config
    from meshnode.node import DEFAULT_SHUTDOWN_GRACE
    from meshnode.serve.service import ServiceOptions
    from meshnode.spec.strategy import CliSpecOptions

    if config is None:
        config = load_config(paths.config_file)
    node_cfg = config.node
    max_memory = args.max_memory if args.max_memory is not None else node_cfg.max_memory
    service = None
    _check_model_options(args)
    if not args.no_model:
        strategy = args.spec_strategy
        if args.draft_model and strategy is None:
            strategy = "draft-model"
        service = ServiceOptions(
            model=args.model, split=args.split, stages=args.stages, max_memory=max_memory,
            n_ctx=args.ctx, n_batch=args.batch, parallel=args.parallel, wire_dtype=args.wire_dtype,
            prefix_cache=args.prefix_cache if args.prefix_cache is not None else node_cfg.prefix_cache,
            threads=args.threads, gpu_layers=args.gpu_layers, aliases=tuple(args.alias),
            spec_cli=CliSpecOptions(strategy=strategy, mode=args.spec_mode, draft_model=args.draft_model,
                                    window_policy=args.draft_policy, window_initial=args.draft_initial,
                                    window_min=args.draft_min, window_max=args.draft_max,
                                    no_draft=args.no_draft),
            config=config)
    security, max_queue = _http_security(args, config.http)
    if service is not None:
        service = dataclasses.replace(service, max_queue=max_queue)
    return dict(
        http_security=security,
        port=_first(args.quic_port, node_cfg.quic_port, 0),
        http_port=_first(args.port, node_cfg.http_port, 8642),
        http_host=args.host, interfaces=args.interface, name=args.name or node_cfg.name,
        static_peers=args.peer, discovery=not args.no_discovery, service=service, threads=args.threads,
        decode_threads=args.decode_threads, gpu_layers=args.gpu_layers, max_memory=max_memory,
        shutdown_grace=_first(args.shutdown_grace, node_cfg.shutdown_grace, DEFAULT_SHUTDOWN_GRACE),
        share=not args.no_share and config.share is not False,
        keep_responses=_first(args.keep_responses, config.http.keep_responses, "disk"),
    )


def _http_security(args: argparse.Namespace, cfg):
    """The endpoint's HttpSecurity and queue bound: flags over $MESHNODE_API_KEY over
    ``[http]``. Raises MeshnodeError for a non-loopback --host without a key."""
    import os

    from meshnode.serve.http_guard import (
        DEFAULT_MAX_BODY,
        DEFAULT_MAX_QUEUE,
        DEFAULT_MAX_REQUESTS,
        HttpSecurity,
        check_binding,
    )

    key = args.api_key or os.environ.get("MESHNODE_API_KEY") or cfg.api_key
    check_binding(args.host, key)
    max_queue = _first(args.max_queue, cfg.max_queue, DEFAULT_MAX_QUEUE)
    security = HttpSecurity(
        api_key=key,
        allowed_hosts=tuple(args.allow_host or cfg.allowed_hosts),
        cors_origins=tuple(args.cors_origin or cfg.cors_origins),
        max_body=_first(args.max_body, cfg.max_body, DEFAULT_MAX_BODY),
        # POSTs in flight at the door: every slot and queue place, and room to refuse
        # the next ones with the model server's own 429
        max_requests=max(DEFAULT_MAX_REQUESTS, args.parallel + max_queue + 8),
        bound_host=args.host,
    )
    return security, max_queue


def cmd_run(args: argparse.Namespace) -> int:
    why_not = None
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        # started by a script, a pipe or a service: a full-screen app would write escape
        # codes into a log and wait for keys that never come
        why_not = "not a terminal"
    else:
        try:
            from ui.app import run_tui  # type: ignore[import-not-found]
        except ImportError as exc:  # a broken install: say what is missing, still serve
            why_not = f"the TUI is not available ({exc})"
    if why_not is not None:
        from meshnode.cli import setup_logging

        setup_logging(args.log_level)
        print(f"meshnode: {why_not}: running headless, as `meshnode serve --headless` (Ctrl-C stops)",
              file=sys.stderr)
        args.headless = True
        return cmd_serve(args)
    from meshnode.config import load_config
    from meshnode.node import Node, freeze_startup_heap
    from meshnode.paths import NodePaths

    pin_cpus(args.cpus)
    paths = NodePaths.resolve(args.home).ensure()
    _log_to_file(args.log_level, paths.state / "meshnode.log")
    config = load_config(paths.config_file)
    kwargs = _node_kwargs(args, paths, config)
    return int(run_tui(lambda: Node(paths, **kwargs), loop_factory=loop_factory(args, config),
                       on_started=freeze_startup_heap) or 0)


def _log_to_file(level_name: str | None, path) -> None:
    """TUI mode: the terminal belongs to the TUI, so logs go to a file (and the Logs screen)."""
    import os

    level = getattr(logging, (level_name or os.environ.get("MESHNODE_LOG_LEVEL") or "info").upper())
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("quic").setLevel(max(level, logging.WARNING))


def pin_cpus(cpus: frozenset[int] | None) -> None:
    """Keep this process (its threads, and every thread it starts later) on ``cpus``.

    For several nodes on one machine: with two stages of a split on the 2-core VM, the
    final stage's step took 11.0 ms unpinned against 8.4 ms with each process on a core
    of its own. Threads started later inherit the mask."""
    if not cpus:
        return
    import os

    from meshnode.errors import MeshnodeError

    if not hasattr(os, "sched_setaffinity"):
        raise MeshnodeError("--cpus needs Linux (this platform cannot pin a process to CPUs)")
    available = os.sched_getaffinity(0)
    missing = sorted(cpus - available)
    if missing:
        raise MeshnodeError(f"--cpus: CPU {cpu_ranges(missing)} not available here "
                            f"(available: {cpu_ranges(available)})")
    os.sched_setaffinity(0, cpus)
    # and the threads already running (a library's pool started at import: numpy's
    # OpenBLAS), which sched_setaffinity(0) leaves where they were
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):   # (a thread that has just ended)
                os.sched_setaffinity(int(task), cpus)


def cmd_serve(args: argparse.Namespace) -> int:
    if not getattr(args, "headless", True):
        return cmd_run(args)
    pin_cpus(args.cpus)
    logging.getLogger("quic").setLevel(logging.WARNING)
    from meshnode.config import load_config
    from meshnode.paths import NodePaths

    config = load_config(NodePaths.resolve(args.home).config_file)   # read once: it logs its warnings
    with asyncio.Runner(loop_factory=loop_factory(args, config)) as runner:
        return runner.run(serve_headless(args, config))


def loop_factory(args: argparse.Namespace, config) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The node's event loop: busy-polling (net/busypoll.py) or asyncio's default (None);
    ``--busy-poll`` / ``--no-busy-poll`` over ``[node] busy_poll`` (``config``) over off."""
    from meshnode.net.busypoll import WINDOW_S, busy_poll_loop_factory

    on = _first(args.busy_poll, config.node.busy_poll, False)
    return busy_poll_loop_factory(WINDOW_S if on else 0.0)


# A graceful stop that runs this long past its grace is stuck (a hung peer, a stuck
# engine call): the process exits anyway, with status 1.
HARD_EXIT_AFTER_S = 2.5
# Once the node has stopped, what still runs is work nobody waits for (a large model
# being hashed, the prefill of an ended request): asyncio.run and the interpreter would
# wait for those threads; they get this long, then the process exits with status 0.
BUSY_THREADS_S = 0.5


def exit_now(code: int, why: str) -> None:
    """Leave at once, without running anything else: a second signal, or a stuck stop."""
    for h in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            h.flush()
    print(f"meshnode: {why}", file=sys.stderr, flush=True)
    os._exit(code)


def _exit_after(seconds: float, code: int, why: str) -> threading.Timer:
    timer = threading.Timer(seconds, exit_now, (code, why))
    timer.daemon = True
    timer.start()
    return timer


async def serve_headless(args: argparse.Namespace, config=None) -> int:
    """Run the node until SIGINT / SIGTERM, then stop it gracefully (status 0); a second
    signal exits at once with 128 + its number (130, 143), as a shell reports a process
    killed by it."""
    from meshnode.node import Node, freeze_startup_heap
    from meshnode.paths import NodePaths

    paths = NodePaths.resolve(args.home)
    node = Node(paths, **_node_kwargs(args, paths, config))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            exit_now(128 + sig, f"{sig.name} again: exiting without waiting")
        log.info("%s: stopping (requests in flight get %.1f s; %s again exits at once)",
                 sig.name, node.shutdown_grace, sig.name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    await node.start()
    freeze_startup_heap()
    print(f"meshnode: node {node.fabric.node_id} ({node.name}) serving {node.http_url}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        stuck = _exit_after(node.shutdown_grace + HARD_EXIT_AFTER_S, 1, "the node did not stop in time; exiting")
        await node.stop()
        stuck.cancel()
        _exit_after(BUSY_THREADS_S, 0, "stopped (not waiting for busy worker threads)")
    return 0
