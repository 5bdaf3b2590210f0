"""`meshnode models certify`: prove a split is bit-identical to the whole model."""

from __future__ import annotations

import argparse
import json
import sys

from meshnode.cli import add_common_options


def register(models_sub: argparse._SubParsersAction) -> None:
    p = models_sub.add_parser(
        "certify",
        help="check that chained slices give exactly the whole model's hidden states and logits",
        description="Run the whole model and the chained slices in one process on a fixed prompt "
        "(prefill, greedy decode, a 4-token verify batch, a rollback) and print, per boundary and "
        "for the final logits, the max absolute difference. Exit 0 only when all are 0 and the "
        "greedy tokens match.",
    )
    add_common_options(p)
    p.add_argument("model", nargs="?", default=None,
                   help="a GGUF path or a model name in the store (default: the default model)")
    p.add_argument("--splits", required=True, metavar="L1,L2,...",
                   help="layers where a new stage starts, e.g. 10,20 for three stages")
    p.add_argument("--decode-steps", type=int, default=16, metavar="N",
                   help="greedy decode steps to compare (default 16, minimum 16)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object (stable interface)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshnode.certify import CertifyError, certify, parse_splits
    from meshnode.models.slicer import SliceCache
    from meshnode.models.store import resolve_model
    from meshnode.paths import NodePaths

    if args.decode_steps < 16:
        raise CertifyError("--decode-steps must be at least 16")
    paths = NodePaths.resolve(args.home).ensure()
    ref = resolve_model(args.model, paths)
    splits = parse_splits(args.splits, ref.n_layers)
    cache = SliceCache(paths)
    report = certify(ref.path, splits, lambda a, b: cache.get(ref, a, b),
                     n_decode=args.decode_steps, n_threads=args.threads)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(f"model {report.model}: {report.n_layers} layers, stages at {report.splits}")
        for b in report.boundaries:
            print(f"  boundary at layer {b.layer:3d}: max |diff| = {b.max_abs_diff:g}")
        print(f"  final logits:           max |diff| = {report.logits_max_abs_diff:g}")
        print(f"  greedy tokens match:    {'yes' if report.greedy_match else 'NO'}")
        print("EXACT" if report.exact else "NOT EXACT", file=sys.stdout)
    return 0 if report.exact else 1
