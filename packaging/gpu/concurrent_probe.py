"""Does a request answered beside others give the text it gives alone?

On CPU every row of a batched step is computed as it would be alone (docs/engine.md), so
concurrent greedy requests are exact. On a GPU two things could break that: several
sessions share one llama.cpp call, whose row count picks the matmul kernels, and every
session of the call attends as many KV cells as the longest one's 256-cell bucket
(docs/engine.md "GPU"). This probe measures it through a real node: one ``meshnode serve``
(or a split, ``--stages 2``) with ``--spec-mode off`` and no prefix cache, every held-out
prompt (code edits and chats, 60 to 1500 tokens, so the sessions sit in different buckets)
asked alone, then all at once, then all at once again started in another order; it prints
how many answers differ from their answer alone and where the first difference is.
With ``--choices N`` it asks each prompt for N greedy choices instead (``n``: the choices
share the prompt's prefill) and counts the choices that differ from the answer alone.

    python packaging/gpu/concurrent_probe.py --model SmolLM2.gguf --gpu-layers all   # a GPU
    python packaging/gpu/concurrent_probe.py --model SmolLM2.gguf --limit 6           # CPU check
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from meshnode.argtypes import gpu_layers, gpu_layers_flag  # noqa: E402
from meshnode.bench import prompt_sets  # noqa: E402
from meshnode.bench.cluster import LocalCluster  # noqa: E402


def ask(base: str, model: str, messages: list[dict], tokens: int) -> list[str]:
    """A greedy completion's text pieces, one per streamed chunk (~one per token); an
    in-band error ends them as a last piece ``<error: ...>``."""
    import httpx

    from meshnode.bench.cluster import sse_chunks

    body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0,
            "stream": True}
    pieces: list[str] = []
    with httpx.Client(timeout=600, trust_env=False) as c, \
            c.stream("POST", f"{base}/chat/completions", json=body) as r:
        r.raise_for_status()
        for chunk in sse_chunks(r):
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                pieces.append(chunk["choices"][0]["delta"]["content"])
            elif "error" in chunk:
                pieces.append(f"<error: {chunk['error'].get('message', chunk['error'])}>")
    return pieces


def ask_choices(base: str, model: str, messages: list[dict], tokens: int, n: int) -> list[str]:
    """The texts of ``n`` greedy choices of one completion (not streamed)."""
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0, "n": n}
    with httpx.Client(timeout=600, trust_env=False) as c:
        r = c.post(f"{base}/chat/completions", json=body)
        r.raise_for_status()
        return [ch["message"]["content"] or "" for ch in sorted(r.json()["choices"], key=lambda ch: ch["index"])]


def first_difference(a: list[str], b: list[str]) -> int | None:
    """Index of the first piece where ``a`` and ``b`` differ, None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def loop_health(log: str) -> str:
    """One line on a node's log: peers it dropped, steps that held its event loop (the
    worker's warning) and, with MESHNODE_STALL_MS, the stall watch's stalls with the
    innermost frame of the longest, and how much of the stalls' time was garbage collection."""
    dropped = log.count(" silent for ")   # "peer ... silent for" and "unreachable and silent for"
    long_steps = log.count("step held the event loop")
    stalls: list[tuple[int, str]] = []
    gc_ms = 0
    frame = ""
    for line in log.splitlines():
        if line.startswith("  File "):
            frame = line.strip()
        elif "event loop stall over:" in line:
            stalls.append((int(line.split("over: ")[1].split(" ")[0]), frame))
            if " in garbage collection" in line:
                gc_ms += int(line.split(", ")[-1].split(" ms")[0])
    out = f"{dropped} peer(s) dropped as silent, {long_steps} long inline step(s)"
    if stalls:
        ms, where = max(stalls)
        out += (f", {len(stalls)} loop stall(s), longest {ms} ms ({where or 'no stack'}); "
                f"{gc_ms} of their {sum(s for s, _ in stalls)} ms in garbage collection")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="GGUF path")
    p.add_argument("--gpu-layers", type=gpu_layers, default=0, metavar="N|all|auto")
    p.add_argument("--stages", type=int, default=1, help="nodes in the route (default 1)")
    p.add_argument("--peer-gpu-layers", type=gpu_layers, default=None, metavar="N|all|auto",
                   help="the other nodes' --gpu-layers (default: --gpu-layers); with 0 and "
                        "--gpu-layers all only stage 0 is on the GPU, and the other way round")
    p.add_argument("--tokens", type=int, default=64, help="tokens per answer (default 64)")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    p.add_argument("--parallel", type=int, default=8, help="the node's --parallel (default 8)")
    p.add_argument("--spec-mode", choices=["off", "auto", "on"], default="off",
                   help="the coordinator's --spec-mode (default off; greedy answers must not change "
                        "with speculation either, so on tests windows and wide calls beside other sessions)")
    p.add_argument("--threads", type=int, default=None,
                   help="every node's --threads (default: theirs; 1 computes steps on the event loop, "
                        "as a GPU node does)")
    p.add_argument("--choices", type=int, default=None, metavar="N",
                   help="instead of the rounds together, ask each prompt for N greedy choices (n)")
    p.add_argument("--logs", type=Path, default=None, metavar="DIR",
                   help="copy every node's whole log into DIR at the end (node0.log, ...)")
    args = p.parse_args()

    prompts = [q for w in prompt_sets.WORKLOADS
               for q in prompt_sets.select(prompt_sets.load(w), "heldout") if q.step == 0]
    prompts = prompts[:args.limit] if args.limit else prompts
    gl = ("--gpu-layers", gpu_layers_flag(args.gpu_layers))
    threads = ("--threads", str(args.threads)) if args.threads else ()
    flags = (*gl, *threads, "--parallel", str(args.parallel), "--max-queue", str(len(prompts)), "--ctx", "4096",
             "--spec-mode", args.spec_mode, "--prefix-cache", "0", "--model", args.model)
    with LocalCluster(Path(args.model), args.stages) as cluster:
        peer = gl if args.peer_gpu_layers is None else ("--gpu-layers", gpu_layers_flag(args.peer_gpu_layers))
        for i in range(1, args.stages):
            cluster.start(i, "--no-model", *peer, *threads, "--parallel", str(args.parallel))
        coord = cluster.start(0, *flags, "--split", str(args.stages)).wait_model()
        base, model = coord.base_url, coord.get("/v1/models")["data"][0]["id"]
        print(f"{len(prompts)} prompts, {args.stages} stage(s), gpu layers {gl[1]} (other nodes {peer[1]}), "
              f"--parallel {args.parallel}, --spec-mode {args.spec_mode}", flush=True)
        t0 = time.monotonic()
        alone = [ask(base, model, q.chat(), args.tokens) for q in prompts]
        print(f"alone: {len(prompts)} answers in {time.monotonic() - t0:.1f} s", flush=True)
        report: dict = {"prompts": len(prompts), "rounds": {}}
        if args.choices:
            differ = {}
            for i, q in enumerate(prompts):
                texts = ask_choices(base, model, q.chat(), args.tokens, args.choices)
                bad = [j for j, t in enumerate(texts) if t != "".join(alone[i])]
                if bad:
                    differ[q.id] = bad
                    print(f"  {q.id}: choices {bad} differ: alone {''.join(alone[i])[:80]!r}, "
                          f"choice {bad[0]} {texts[bad[0]][:80]!r}", flush=True)
            report["rounds"][f"{args.choices} choices"] = {"differ": len(differ), "choices": differ}
            print(f"{args.choices} choices: {len(differ)} of {len(prompts)} prompts have a choice that differs "
                  f"from the answer alone", flush=True)
        for name, order in () if args.choices else (("together", list(range(len(prompts)))),
                                                    ("together, reversed", list(range(len(prompts)))[::-1])):
            with ThreadPoolExecutor(len(prompts)) as ex:
                got = dict(zip(order, ex.map(lambda i: ask(base, model, prompts[i].chat(), args.tokens),
                                             order)))
            # the text decides; pieces (~tokens) say where, and pieces that differ in a
            # text that does not would be the stream cutting the same text otherwise
            same_text = {i: "".join(alone[i]) == "".join(got[i]) for i in order}
            bad = {prompts[i].id: first_difference(alone[i], got[i]) for i in order if not same_text[i]}
            recut = [prompts[i].id for i in order if same_text[i] and alone[i] != got[i]]
            report["rounds"][name] = {"differ": len(bad), "first_difference_at": bad, "recut": recut}
            print(f"{name}: {len(bad)} of {len(prompts)} answers differ from their answer alone"
                  + (f" (first differing piece: {bad})" if bad else "")
                  + (f"; the same text cut into other pieces: {recut}" if recut else ""), flush=True)
            for i in order:
                if prompts[i].id in bad:
                    k = bad[prompts[i].id]
                    print(f"  {prompts[i].id}: alone {alone[i][max(0, k - 3):k + 4]!r}\n"
                          f"  {' ' * len(prompts[i].id)}  together {got[i][max(0, k - 3):k + 4]!r}", flush=True)
        if any(r["differ"] for r in report["rounds"].values()):
            for node in cluster.nodes:   # what the nodes said about it
                said = [ln for ln in node.log_tail(200_000).splitlines() if " WARNING " in ln or " ERROR " in ln]
                print(f"{node.name}: {len(said)} warning/error lines" + "".join(f"\n  {ln[:300]}" for ln in said[-15:]),
                      flush=True)
        for node in cluster.nodes:   # always: a drop or a long loop stall matters even when no text changed
            print(f"{node.name}: {loop_health(node.log_path.read_text(errors='replace'))}", flush=True)
        if args.logs is not None:
            args.logs.mkdir(parents=True, exist_ok=True)
            for node in cluster.nodes:
                shutil.copyfile(node.log_path, args.logs / f"{node.name}.log")
    print(json.dumps(report))
    return 1 if any(r["differ"] for r in report["rounds"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
