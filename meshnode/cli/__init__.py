"""`meshnode` command line.

Each command group lives in its own module exposing ``register(subparsers)``; handlers
import heavy modules (llama_cpp, aioquic, textual) lazily so ``--help`` stays instant.
A handler returns an exit code. A :class:`~meshnode.errors.MeshnodeError` (the user's
mistake or the environment's) is printed as one line, never as a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys

from meshnode import __version__
from meshnode.errors import MeshnodeError

# Command modules, in the order they appear in --help.
COMMAND_MODULES = ("run", "mesh", "models", "bench", "service")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshnode",
        description="Pool the computers on a LAN into one LLM server. "
        "With no command: start this node and open the TUI.",
    )
    parser.add_argument("--version", action="version", version=f"meshnode {__version__}")
    add_common_options(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"meshnode.cli.{name}").register(sub)
    return parser


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """Options every command accepts (before or after the command name)."""
    parser.add_argument(
        "--home", metavar="DIR", default=argparse.SUPPRESS,
        help="keep identity, config, models and cache under DIR "
        "(default: $MESHNODE_HOME, else the platform's user directories)",
    )
    parser.add_argument(
        "--log-level", default=argparse.SUPPRESS,
        choices=["debug", "info", "warning", "error"],
        help="logging level (default: info; also $MESHNODE_LOG_LEVEL)",
    )


def setup_logging(level_name: str | None) -> None:
    import os

    level_name = (level_name or os.environ.get("MESHNODE_LOG_LEVEL") or "info").upper()
    logging.basicConfig(
        level=getattr(logging, level_name, logging.INFO),
        format="%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    return set()


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # the reader left (`meshnode status | head`): no traceback, now or when Python
        # flushes stdout into the closed pipe at exit; 141 as a shell reports SIGPIPE
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Bare `meshnode [node options]` is `meshnode run [node options]`: the node plus its TUI.
    if not ({"-h", "--help", "--version"} & set(argv)) and not (_commands(parser) & set(argv)):
        args, extra = parser.parse_known_args(["run", *argv])
        if extra:
            if not extra[0].startswith("-"):   # `meshnode confg`: a mistyped command, not an option
                parser.error(f"unknown command {extra[0]!r} (commands: "
                             f"{', '.join(sorted(_commands(parser)))}; `meshnode --help`)")
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    else:
        args = parser.parse_args(argv)
    for opt in ("home", "log_level"):
        if not hasattr(args, opt):
            setattr(args, opt, None)
    if not getattr(args, "tui_logging", False):
        setup_logging(args.log_level)
    from meshnode.quantizer import hand_in_quantizer

    hand_in_quantizer()   # the default model is made by it on first use
    try:
        return int(args.func(args) or 0)
    except MeshnodeError as exc:
        print(f"meshnode: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("meshnode: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
