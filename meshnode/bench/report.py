"""`meshnode bench report`: run the benchmark suite and write docs/benchmarks.md's results.

Runs ``bench engine``, ``bench net``, ``bench serve`` and ``bench spec`` one after
another, each as a subprocess of its own with ``--json`` (a benchmark starts node
processes, sets up logging and pins threads; a process of its own keeps one from
disturbing the next), collects their JSON, and writes:

- the results block of the markdown file (``--out``): the machine, then per benchmark
  the exact command, a table and how to read it. Only the part between the
  ``<!-- bench report: begin -->`` and ``<!-- bench report: end -->`` markers is
  replaced, so the hand-written reference below it stays; a file without the markers
  is written whole;
- bar charts as hand-made SVG into ``--charts`` (decode tokens/s, acceptance, prefill,
  concurrency), linked from the markdown;
- ``results.json`` next to the charts: the raw JSON and the machine, so
  ``--from-json`` renders again without running anything.

Rendering (:func:`render`) is pure: JSON in, markdown and SVG text out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from xml.sax.saxutils import escape

from meshnode.bench.timeline import TokenPath

HELP = "run the benchmark suite and write docs/benchmarks.md's results with SVG charts"

BEGIN = "<!-- bench report: begin (written by `meshnode bench report`; edit the code, not this) -->"
END = "<!-- bench report: end -->"

# benchmark -> arguments for (--quick, full). The full set is each benchmark's defaults.
SUITE: dict[str, tuple[list[str], list[str]]] = {
    "engine": (["--tokens", "32", "--warmup", "4", "--prefill", "128", "--reps", "3"], []),
    "net": (["--iters", "50", "--bulk-mb", "8"], []),
    "serve": (["--quick"], []),
    "spec": (["--quick"], []),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="each benchmark's quick settings (a few minutes on 2 cores; "
                             "default: their defaults, about 20 minutes)")
    parser.add_argument("--out", default="docs/benchmarks.md", metavar="FILE",
                        help="markdown file whose results block is replaced (default docs/benchmarks.md)")
    parser.add_argument("--charts", default="docs/bench", metavar="DIR",
                        help="folder for the SVG charts and results.json (default docs/bench)")
    parser.add_argument("--only", default=",".join(SUITE), metavar="B1,B2",
                        help=f"benchmarks to run (default {','.join(SUITE)})")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="render from a results.json written earlier instead of running")


# ---- machine ---------------------------------------------------------------------------


def machine_info() -> dict:
    """What the numbers were measured on; every field degrades to "unknown"."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "unknown"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 0
    ram_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gib = int(line.split()[1]) / 2**20
                break
    except OSError:
        pass
    try:
        from importlib.metadata import version

        llama = version("llama_cpp_python")
    except Exception:
        llama = "unknown"
    from meshnode import __version__

    return {"cpu": cpu, "cores": cores, "ram_gib": ram_gib, "os": platform.platform(),
            "python": platform.python_version(), "llama_cpp_python": llama,
            "meshnode": __version__, "commit": _commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "loadavg_before": list(os.getloadavg())}


def _commit() -> str | None:
    """The checkout's commit, when meshnode runs from one (an installed wheel has none)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5, cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ---- running ---------------------------------------------------------------------------


def _parse_json(stdout: str):
    """``bench net`` prints indented JSON as its whole output; the others end with one line."""
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        pass
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith(("{", "[")):
            return json.loads(line)
    raise ValueError("no JSON in the output")


def run_suite(names: list[str], quick: bool, home: str | None) -> dict:
    results: dict = {"machine": machine_info(), "quick": quick, "commands": {}, "seconds": {},
                     "benchmarks": {}, "errors": {}}
    for name in names:
        extra = SUITE[name][0 if quick else 1]
        shown = ["meshnode", "bench", name, *extra, "--json"]
        argv = [sys.executable, "-m", "meshnode", *(["--home", home] if home else []), *shown[1:]]
        results["commands"][name] = shlex.join(shown)
        print(f"bench report: {shlex.join(shown)}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        # stderr passes through: the benchmarks' progress lines show while they run
        proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
        results["seconds"][name] = round(time.perf_counter() - t0, 1)
        try:
            if proc.returncode != 0:
                raise ValueError(f"exit status {proc.returncode}")
            results["benchmarks"][name] = _parse_json(proc.stdout)
        except ValueError as e:
            results["errors"][name] = str(e)
            print(f"bench report: {name} failed ({e}); its section says so", file=sys.stderr)
    results["machine"]["loadavg_after"] = list(os.getloadavg())
    return results


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SUITE]
    if unknown or not names:
        print(f"meshnode bench report: --only takes some of {','.join(SUITE)}", file=sys.stderr)
        return 2
    charts, out = Path(args.charts), Path(args.out)
    # checked before the suite runs for many minutes, not when its results are written
    why = _unwritable(out, folder=False) or _unwritable(charts, folder=True)
    if why:
        print(f"meshnode bench report: {why}", file=sys.stderr)
        return 2
    if args.from_json:
        try:
            results = json.loads(Path(args.from_json).read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"meshnode bench report: cannot read {args.from_json}: {e}", file=sys.stderr)
            return 2
    else:
        results = run_suite(names, args.quick, getattr(args, "home", None))
    rel = os.path.relpath(charts, out.parent if str(out.parent) else ".")
    markdown, svgs = render(results, charts_rel=rel)
    charts.mkdir(parents=True, exist_ok=True)
    for fname, text in svgs.items():
        (charts / fname).write_text(text)
    if not args.from_json:
        (charts / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    existing = out.read_text() if out.exists() else ""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(splice(existing, markdown))
    print(f"bench report: wrote {out} and {len(svgs)} chart(s) in {charts}", file=sys.stderr)
    return 1 if results.get("errors") else 0


def _unwritable(path: Path, *, folder: bool) -> str | None:
    """Why ``path`` (a file, or with ``folder`` a directory) cannot be written; None if it can."""
    if path.exists() and path.is_dir() != folder:
        return f"{path}: {'not a directory' if folder else 'a directory, not a file'}"
    parent = path if folder else path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        return f"{path}: cannot write in {parent}"
    return None


def splice(existing: str, block: str) -> str:
    """Replace the text between the markers; a file without them is written whole."""
    if BEGIN in existing and END in existing:
        head, rest = existing.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        return f"{head}{BEGIN}\n{block}{END}{tail}"
    return f"# Benchmarks\n\n{BEGIN}\n{block}{END}\n"


# ---- rendering (pure) ------------------------------------------------------------------


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _table(header: list[str], rows: list[list[str]], text_columns: int = 1) -> str:
    """A markdown table: the first ``text_columns`` columns left-aligned, numbers right."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < text_columns else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1")


def bar_chart(title: str, unit: str, rows: list[tuple[str, float, int]], digits: int = 1) -> str:
    """Horizontal bars: (label, value, colour index) per row, the value printed after the bar."""
    label_w, bar_w, row_h, top = 300, 360, 22, 34
    width = label_w + bar_w + 80
    height = top + row_h * len(rows) + 26
    vmax = max((v for _, v, _ in rows), default=0) or 1.0
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
           f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>']
    for i, (label, value, colour) in enumerate(rows):
        y = top + i * row_h
        w = max(0.0, value) / vmax * bar_w
        out.append(f'<text x="{label_w - 8}" y="{y + 15}" text-anchor="end">{escape(label)}</text>')
        out.append(f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" '
                   f'fill="{PALETTE[colour % len(PALETTE)]}"/>')
        out.append(f'<text x="{label_w + w + 5:.1f}" y="{y + 15}">{value:.{digits}f}</text>')
    y = top + row_h * len(rows) + 16
    out.append(f'<text x="{label_w}" y="{y}" fill="#555555">{escape(unit)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _machine(m: dict, quick: bool, seconds: dict) -> str:
    ram = f"{m['ram_gib']:.1f} GiB" if m.get("ram_gib") else "unknown"
    la = lambda k: " / ".join(f"{x:.2f}" for x in m.get(k) or []) or "unknown"  # noqa: E731
    total = sum(seconds.values())
    lines = [
        f"- CPU: {m.get('cpu', 'unknown')}, {m.get('cores', '?')} core(s) usable by this process",
        f"- RAM: {ram}; OS: {m.get('os', 'unknown')}",
        f"- Python {m.get('python', '?')}, llama-cpp-python {m.get('llama_cpp_python', '?')}, "
        f"meshnode {m.get('meshnode', '?')}" + (f" (commit {m['commit']})" if m.get("commit") else ""),
        f"- Measured {m.get('date', '?')}; load average (1 / 5 / 15 min) {la('loadavg_before')} "
        f"before, {la('loadavg_after')} after; {total:.0f} s in all",
        f"- Settings: {'quick (`--quick`)' if quick else 'full (each benchmark’s defaults)'}",
    ]
    return "\n".join(lines) + "\n"


def _engine(d: dict) -> str:
    dec, pre = d["decode_ms_per_token"], d["prefill_tokens_per_s"]
    names = [f"[{a},{b})" for a, b in zip([0, *d["splits"]], [*d["splits"], d["n_layers"]])]
    rows = [["decode ms/token", _f(dec["whole"], 2), _f(dec["chain"], 2), _f(dec["ratio"], 3)],
            ["prefill tokens/s", _f(pre["whole"]), _f(pre["chain"]), _f(pre["ratio"], 3)]]
    md = (f"{d['model']} ({d['n_layers']} layers), stages {' '.join(names)}, {d['threads']} thread(s), "
          f"batch {d['batch']}, {d['tokens']} decode steps, {d['prefill_tokens']}-token prefill.\n\n")
    md += _table(["", "whole model", "chained slices", "chain / whole"], rows)
    md += "\nPer stage: decode ms/token " + ", ".join(
        f"{n} {_f(t, 2)}" for n, t in zip(names, d["decode_stage_ms"]))
    md += "; prefill ms/chunk " + ", ".join(
        f"{n} {_f(t)}" for n, t in zip(names, d["prefill_stage_ms_per_chunk"])) + ".\n"
    md += f"Decode logits identical on both paths: {'yes' if d['chain_logits_identical'] else '**NO**'}.\n"
    gap = d.get("idle_gap")
    if gap:
        md += (f"Whole model, one step after {gap['gap_ms']:g} ms idle: {_f(gap['after_gap'], 2)} ms "
               f"against {_f(gap['back_to_back'], 2)} ms right after the previous one "
               f"({_f(gap['ratio'], 2)}x).\n")
    md += ("\nHow to read it: the chain / whole ratio is the cost of slicing the model itself "
           "(no network): 1.00 means free; decode above 1 and prefill below 1 are the overhead.\n")
    return md


def _net(d: list) -> str:
    base = d[0]
    keys = list(base["rtt"])
    header = ["round trip (one row out, one token back)"] + [f"{r['datagram']} B median ms" for r in d]
    rows = [[k] + [_f(r["rtt"][k]["median_ms"], 3) if k in r["rtt"] else "-" for r in d] for k in keys]
    md = _table(header, rows)
    md += "\n" + _table(["bulk, Forward frames"] + [f"{r['datagram']} B MB/s" for r in d],
                        [[k] + [_f(r["bulk"].get(k)) for r in d] for k in base["bulk"]])
    md += ("\nHow to read it: a row `W x f16` carries one activation row of W floats; rows marked "
           "`lane` make the same exchange on the fast lane instead of a QUIC stream. Loopback "
           "only: this is the software cost per hop, add the LAN's own latency on top.\n")
    return md


def _serve(d: dict) -> str:
    md = ""
    for model, res in d.items():
        stages = sorted((k for k in res if k.isdigit()), key=int)
        conc = list(res["ceiling_tok_s"])
        header = ["stages", "decode tok/s", "vs 1 node", "(min-max)", "TTFT ms", "prefill tok/s"]
        header += [f"agg@{c} tok/s" for c in conc]
        rows = []
        for n in stages:
            r = res[n]
            lo, hi = r["decode_ratio_range"]
            rows.append([n, _f(r["decode_tok_s"]), f"{r['decode_ratio']:.2f}x", f"{lo:.2f}-{hi:.2f}",
                         _f(r["ttft_ms"], 0), _f(r["prefill_tok_s"])]
                        + [f"{_f(r['aggregate_tok_s'][c])} ({r['aggregate_over_ceiling'][c]:.2f})"
                           for c in conc])
        rows.append(["engine ceiling", "", "", "", "", ""] + [_f(res["ceiling_tok_s"][c]) for c in conc])
        md += f"{model}, medians of {res['rounds']} interleaved rounds:\n\n" + _table(header, rows) + "\n"
        paths = {n: t for n, t in (res.get("token_path") or {}).items() if "steps" in t}
        if paths:
            md += "Where a one-stream decode token's time goes, marked in the nodes (us; sN = stage N):\n\n"
            md += "".join(f"- {n} stage(s): {TokenPath.from_dict(t).line()}\n" for n, t in sorted(paths.items()))
            md += "\n"
    md += ("How to read it: `vs 1 node` is the split's decode speed over the single node's, paired "
           "within each round (median, min-max over rounds). `agg@C` is the tokens/s of C "
           "concurrent streams while all of them decode; in brackets, over the engine ceiling "
           "(the same engine decoding C sessions in one batch in-process). All stages share this "
           "machine's cores, so a split here shows the cost of splitting, not the gain of more "
           "machines. The token path follows each decode step through the nodes: each stage's "
           "llama.cpp call (`compute`), the Python around it, and each hop from a `sendto` to "
           "the next node's receive (docs/benchmarks.md, `bench serve`).\n")
    return md


def _spec(d: dict) -> str:
    rows = []
    for w, strategies in d.items():
        for s, r in strategies.items():
            # (results.json files written before wall clock was measured lack the first three)
            wall_x = r.get("wall_speedup")
            rows.append([w, s, _f(r.get("wall_tok_s")), "-" if wall_x is None else f"{wall_x:.2f}x",
                         _f(r.get("ttft_ms"), 0),
                         _f(r["tok_s"]), f"{r['speedup']:.2f}x", _f(r["acceptance"], 2), str(r["draft_n"]),
                         "yes" if r["same_text_as_baseline"] else "**NO**"])
    md = _table(["workload", "strategy", "wall t/s", "wall x", "TTFT ms", "decode t/s", "decode x",
                 "acceptance", "drafted", "same text"], rows, text_columns=2)
    md += ("\nHow to read it: a 2-stage split on loopback with 5 ms of emulated latency each way, "
           "one thread per stage, the held-out prompts. `wall x` is the client's tokens/s, "
           "prefill included, over `baseline` (no speculation) on the same prompts: what a user "
           "waits for; `decode x` counts decoding only; TTFT is the time to the first token. "
           "Acceptance is accepted / drafted tokens. Greedy decoding, so every strategy must give "
           "the baseline's text. The `draft` strategy's draft is the target requantized to Q4_0 "
           "(`bench spec`, docs/benchmarks.md).\n")
    return md


def _charts(b: dict) -> dict[str, tuple[str, str]]:
    """name -> (svg, alt text) for the charts the results allow."""
    out: dict[str, tuple[str, str]] = {}
    serve, spec, engine = b.get("serve"), b.get("spec"), b.get("engine")
    rows: list[tuple[str, float, int]] = []
    if serve:
        res = next(iter(serve.values()))
        for n in sorted((k for k in res if k.isdigit()), key=int):
            rows.append(("1 node" if n == "1" else f"{n}-stage split", res[n]["decode_tok_s"], 0))
    if spec:
        for i, (w, strategies) in enumerate(spec.items()):
            for s, r in strategies.items():
                label = {"baseline": "no speculation", "ngram_auto": "n-gram", "draft": "draft model"}.get(s, s)
                rows.append((f"2 stages + 5 ms, {label}, {w}", r["tok_s"], 1 + i))
    if rows:
        out["decode.svg"] = (bar_chart("Decode tokens/s: one node, splits, splits with speculation",
                                       "tokens/s, one stream (higher is better)", rows),
                             "decode tokens/s by configuration")
    if spec:
        rows = [(f"{w}, {s}", r["acceptance"], 1 + i) for i, (w, st) in enumerate(spec.items())
                for s, r in st.items() if s != "baseline"]
        if rows:
            out["acceptance.svg"] = (bar_chart("Draft acceptance per workload", "accepted / drafted tokens",
                                               rows, digits=2), "acceptance per workload and strategy")
    rows = []
    if engine:
        pre = engine["prefill_tokens_per_s"]
        rows += [("in-process, whole model", pre["whole"], 0), ("in-process, chained slices", pre["chain"], 0)]
    if serve:
        res = next(iter(serve.values()))
        rows += [("served, 1 node" if n == "1" else f"served, {n}-stage split", res[n]["prefill_tok_s"], 1)
                 for n in sorted((k for k in res if k.isdigit()), key=int)]
    if rows:
        out["prefill.svg"] = (bar_chart("Prefill tokens/s", "prompt tokens/s (higher is better)", rows),
                              "prefill tokens/s")
    if serve:
        res = next(iter(serve.values()))
        rows = []
        for i, c in enumerate(res["ceiling_tok_s"]):
            streams = "1 stream" if c == "1" else f"{c} streams"
            for n in sorted((k for k in res if k.isdigit()), key=int):
                rows.append((f"{streams}, {'1 node' if n == '1' else n + ' stages'}",
                             res[n]["aggregate_tok_s"][c], i))
            rows.append((f"{streams}, engine ceiling", res["ceiling_tok_s"][c], i))
        out["concurrency.svg"] = (bar_chart("Aggregate decode tokens/s by concurrency",
                                            "tokens/s over all streams (higher is better)", rows),
                                  "aggregate tokens/s by concurrency")
    return out


SECTIONS = (
    ("engine", "Engine: whole model against its chained slices", _engine, ("prefill.svg",)),
    ("serve", "Serving: one node against 2- and 3-stage splits", _serve,
     ("decode.svg", "concurrency.svg")),
    ("spec", "Speculative decoding on a 2-stage split", _spec, ("acceptance.svg",)),
    ("net", "Network: QUIC round trips and bulk throughput on loopback", _net, ()),
)


def render(results: dict, charts_rel: str = "bench") -> tuple[str, dict[str, str]]:
    """The results block (markdown) and the charts (file name -> SVG text)."""
    b, cmds = results.get("benchmarks", {}), results.get("commands", {})
    errors = results.get("errors", {})
    charts = _charts(b)
    run_cmd = "meshnode bench report" + (" --quick" if results.get("quick") else "")
    md = ["## Results\n",
          f"Written by `{run_cmd}`, which ran each command below in turn. Every benchmark "
          "measures its baseline in the same invocation: compare ratios, not absolute "
          "numbers across machines.\n",
          "### Machine\n", _machine(results.get("machine", {}), bool(results.get("quick")),
                                    results.get("seconds", {}))]
    for name, title, body, chart_names in SECTIONS:
        if name not in b and name not in errors:
            continue
        md.append(f"### {title}\n")
        if name in cmds:
            md.append(f"```\n$ {cmds[name]}\n```\n")
        if name in errors:
            md.append(f"Did not complete: {errors[name]}.\n")
            continue
        md.append(body(b[name]))
        for c in chart_names:
            if c in charts:
                md.append(f"![{charts[c][1]}]({charts_rel}/{c})\n")
    return "\n".join(md), {name: svg for name, (svg, _) in charts.items()}
