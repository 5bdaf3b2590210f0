"""`meshnode models certify`: prove a split is bit-identical to the whole model."""

from __future__ import annotations

import argparse
import json
import sys

from meshnode.argtypes import gpu_layers, positive_int
from meshnode.cli import add_common_options


def register(models_sub: argparse._SubParsersAction) -> None:
    p = models_sub.add_parser(
        "certify",
        help="check that chained slices give exactly the whole model's hidden states and logits",
        description="Run the whole model and the chained slices in one process on a fixed prompt "
        "(prefill, greedy decode, a 4-token verify batch, a rollback) and print, per boundary and "
        "for the final logits, the max absolute difference. Exit 0 only when all are 0 and the "
        "greedy tokens match. With --schedule, also check that verify windows of 2-32 rows give "
        "exactly the logits of one-row steps at several context lengths (what exact speculation "
        "needs), and that sessions decoded together get each one's logits alone (what serving "
        "several requests at once needs); run it on every backend a mesh uses (e.g. on a GPU "
        "node with --gpu-layers all).",
    )
    add_common_options(p)
    p.add_argument("model", nargs="?", default=None,
                   help="a GGUF path or a model name in the store (default: the default model)")
    p.add_argument("--splits", default=None, metavar="L1,L2,...",
                   help="layers where a new stage starts, e.g. 10,20 for three stages "
                        "(required unless --schedule is given)")
    p.add_argument("--schedule", action="store_true",
                   help="check the batch schedule: one-row steps against windows of 2-32 rows, "
                        "and sessions decoded together against each alone")
    p.add_argument("--contexts", default=None, metavar="N,N,...",
                   help="context lengths for --schedule (default 16,200,490,600; 490 crosses a KV bucket)")
    p.add_argument("--windows", default=None, metavar="N,N,...",
                   help="window sizes for --schedule, 2-32 rows (default 2,4,8,16,32)")
    p.add_argument("--decode-steps", type=int, default=16, metavar="N",
                   help="greedy decode steps to compare (default 16, minimum 16)")
    p.add_argument("--threads", type=positive_int, default=None, help="llama.cpp threads (default: all cores)")
    p.add_argument("--decode-threads", type=positive_int, default=None, metavar="N",
                   help="llama.cpp threads for one-token steps in --schedule (default: --threads)")
    p.add_argument("--gpu-layers", type=gpu_layers, default=0, metavar="N|all|auto",
                   help="layers of every engine to offload to the GPU (default 0: CPU only)")
    p.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto",
                   help="llama.cpp flash attention (default auto: off on a GPU, llama.cpp's choice on CPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object (stable interface)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshnode.certify import CertifyError, certify, parse_splits, schedule_check
    from meshnode.models.slicer import SliceCache
    from meshnode.models.store import resolve_model
    from meshnode.paths import NodePaths

    if args.decode_steps < 16:
        raise CertifyError("--decode-steps must be at least 16")
    if args.splits is None and not args.schedule:
        raise CertifyError("give --splits (a split to certify), --schedule, or both")
    contexts = None
    if args.contexts is not None:
        try:
            contexts = sorted({int(x) for x in args.contexts.split(",") if x.strip()})
        except ValueError:
            raise CertifyError(f"--contexts must be comma-separated numbers, got {args.contexts!r}") from None
        if not contexts or contexts[0] < 1 or contexts[-1] > 32768:
            raise CertifyError("--contexts must be numbers in 1..32768")
    windows = None
    if args.windows is not None:
        try:
            windows = sorted({int(x) for x in args.windows.split(",") if x.strip()})
        except ValueError:
            raise CertifyError(f"--windows must be comma-separated numbers, got {args.windows!r}") from None
        if not windows or windows[0] < 2 or windows[-1] > 32:
            raise CertifyError("--windows must be numbers in 2..32")
    flash = {"auto": None, "on": True, "off": False}[args.flash_attn]
    paths = NodePaths.resolve(args.home).ensure()
    ref = resolve_model(args.model, paths)
    ok = True
    out: dict = {}
    if args.splits is not None:
        splits = parse_splits(args.splits, ref.n_layers)
        cache = SliceCache(paths)
        report = certify(ref.path, splits, lambda a, b: cache.get(ref, a, b),
                         n_decode=args.decode_steps, n_threads=args.threads,
                         gpu_layers=args.gpu_layers, flash_attn=flash)
        ok = ok and report.exact
        out = report.to_json()
        if not args.json:
            print(f"model {report.model}: {report.n_layers} layers, stages at {report.splits}")
            for b in report.boundaries:
                print(f"  boundary at layer {b.layer:3d}: max |diff| = {b.max_abs_diff:g}")
            print(f"  final logits:           max |diff| = {report.logits_max_abs_diff:g}")
            print(f"  greedy tokens match:    {'yes' if report.greedy_match else 'NO'}")
            print("EXACT" if report.exact else "NOT EXACT", file=sys.stdout)
    if args.schedule:
        kw: dict = {} if contexts is None else {"contexts": contexts}
        if windows is not None:
            kw["windows"] = windows
        sched = schedule_check(ref.path, n_threads=args.threads, decode_threads=args.decode_threads,
                               gpu_layers=args.gpu_layers, flash_attn=flash, **kw)
        ok = ok and sched.exact
        out["schedule"] = sched.to_json()
        if not args.json:
            print(f"batch schedule of {sched.model} on {sched.backend} ({sched.gpu_layers} GPU layers): "
                  "one-row steps against windows")
            for c in sched.cases:
                where = "" if c.first_diff_row is None else f", first at row {c.first_diff_row}"
                print(f"  context {c.context:5d}, window {c.window:2d}: max |diff| = {c.max_abs_diff:g}"
                      f"{where}{'' if c.greedy_match else ', greedy tokens DIFFER'}")
            t = sched.together
            if t is not None:
                print(f"  {len(t.contexts)} sessions together (contexts {','.join(map(str, t.contexts))}) against "
                      f"each alone: max |diff| = {t.max_abs_diff:g}"
                      + (f", {t.sessions_differ} session(s) differ" if t.sessions_differ else "")
                      + ("" if t.greedy_match else ", greedy tokens DIFFER"))
            print("SCHEDULE EXACT" if sched.exact else "SCHEDULE NOT EXACT")
    if args.json:
        out["exact"] = ok
        print(json.dumps(out))
    return 0 if ok else 1
