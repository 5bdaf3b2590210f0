"""`meshnode bench ...`: benchmarks that print numbers and ratios against a baseline run
in the same invocation. Each benchmark is a module in ``meshnode/bench`` exposing
``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib

from meshnode.cli import add_common_options

# name -> module under meshnode.bench
BENCHMARKS = {
    "engine": "engine_bench",
    "flood": "flood_bench",
    "net": "net_bench",
    "prefix": "prefix_bench",
    "replay": "replay_bench",
    "score": "score_bench",
    "report": "report",
    "sample": "sample_bench",
    "serve": "serve_bench",
    "share": "share_bench",
    "soak": "soak_bench",
    "spec": "spec_bench",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark (prints numbers and ratios vs a baseline)")
    bench_sub = p.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        try:
            module = importlib.import_module(f"meshnode.bench.{module_name}")
        except ImportError:
            continue  # not built yet
        bp = bench_sub.add_parser(name, help=module.HELP, description=module.HELP)
        add_common_options(bp)
        module.add_arguments(bp)
        bp.set_defaults(func=module.run)
