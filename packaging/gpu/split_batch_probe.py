"""Does a 2-stage split compute every session's rows as it would alone, whatever the
sessions' steps are grouped with? The engine-level twin of concurrent_probe.py, in one
process and without a network, so that a difference names the stage and the grouping.

Two engines as a split has them (layers [0, n/2) with the capture tap, [n/2, n) from
hidden states with the head), the node's own path (``StageEngine.forward`` with
``rewind``). Each of eight sessions follows a fixed script: its prompt in chunks of 64
(the last asks one logits row), then one-row steps and, with ``--windows``, verify
windows of 2-4 rows after which 1 to all of their rows are kept (the next step rewinds
over the rest). Tokens are random and fixed, so the reference and every other run feed
the same rows. Reference: each session alone, from a fresh call-shape state. Then
``--schedules`` runs where every round a random subset of the sessions takes its next
step, in random order, cut into random groups of 1-4 segments, differently on each
stage (stage 1 receives what stage 0 sent, batched its own way). Every output, stage
0's hidden rows and stage 1's logits, is compared with the reference bit for bit; the
first differences are printed with the grouping that gave them.

    python packaging/gpu/split_batch_probe.py MODEL.gguf [--windows] [--schedules 6]
    MESHNODE_GPU_STICKY_CALLS=32 python packaging/gpu/split_batch_probe.py MODEL.gguf \\
        --pad 2 --windows --gpu-layers 0      # the probe itself, on CPU
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from meshnode.argtypes import gpu_layers  # noqa: E402
from meshnode.engine import EngineConfig, Segment, StageEngine  # noqa: E402
from meshnode.models.slicer import SliceCache  # noqa: E402
from meshnode.models.store import resolve_model  # noqa: E402
from meshnode.paths import NodePaths  # noqa: E402

CTXS = (40, 57, 75, 90, 104, 131, 220, 300)   # mostly one 256-cell bucket, as chats are; one crosses
CHUNK = 64


def script(rng: np.random.Generator, ctx: int, steps: int, windows: bool) -> list[tuple[int, int, int]]:
    """(pos, rows, n_logits) of each step of one session."""
    out = [(a, min(CHUNK, ctx - a), 1 if a + CHUNK >= ctx else 0) for a in range(0, ctx, CHUNK)]
    pos = ctx
    for _ in range(steps):
        n = int(rng.integers(2, 5)) if windows and rng.random() < 0.25 else 1
        out.append((pos, n, n))
        pos += int(rng.integers(1, n + 1)) if n > 1 else 1
    return out


def _diff(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.max(np.abs(x - y))) if x.size else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--gpu-layers", type=gpu_layers, default="all")
    p.add_argument("--pad", type=int, default=None, help="pad rows (default: the engine's own)")
    p.add_argument("--steps", type=int, default=60, help="decode steps per session (default 60)")
    p.add_argument("--windows", action="store_true", help="verify windows of 2-4 rows among the steps")
    p.add_argument("--schedules", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    paths = NodePaths.resolve(None).ensure()
    ref = resolve_model(args.model, paths)
    half = ref.n_layers // 2
    cache = SliceCache(paths)
    common = dict(n_ctx=1024, n_batch=CHUNK, n_seq_max=len(CTXS), gpu_layers=args.gpu_layers, pad_rows=args.pad)
    a = StageEngine(EngineConfig(cache.get(ref, 0, half), takes_tokens=True, has_head=False, **common))
    b = StageEngine(EngineConfig(cache.get(ref, half, ref.n_layers), takes_tokens=False, has_head=True, **common))
    rng = np.random.default_rng(args.seed)
    scripts = [script(rng, c, args.steps, args.windows) for c in CTXS]
    tokens = [rng.integers(0, min(a.n_vocab, 32000), size=max(pos + n for pos, n, _ in s), dtype=np.int32)
              for s in scripts]

    def run(sessions: list[int], cut) -> dict[int, list]:
        """Each of ``sessions`` through its script, a round at a time; ``cut(ready,
        some)`` groups a round's sessions into calls (``some``: may leave some out, for
        stage 0; stage 1 takes the sessions stage 0 ran). Per session and step: stage 0's
        hidden rows, stage 1's logits, and the calls that computed them ((pos, rows) of
        each segment and the calls left wide after it, on stage 0 then stage 1)."""
        for s in sessions:
            a.drop(s)
            b.drop(s)
        got: dict[int, list] = {s: [] for s in sessions}
        nxt = dict.fromkeys(sessions, 0)

        def seg(s: int, hidden: np.ndarray | None = None) -> Segment:
            pos, n, n_logits = scripts[s][nxt[s]]
            if hidden is None:
                return Segment(s, pos, tokens=tokens[s][pos:pos + n], n_logits=n_logits)
            return Segment(s, pos, hidden=hidden, n_logits=n_logits)

        def rows(s: int) -> int:
            return scripts[s][nxt[s]][1]

        while ready := [s for s in sessions if nxt[s] < len(scripts[s])]:
            hid: dict[int, np.ndarray] = {}
            calls: dict[int, list] = {}
            for g in cut(ready, True, rows):
                for s, out in zip(g, a.forward([seg(s) for s in g], rewind=True)):
                    hid[s] = out
                    calls[s] = [[scripts[t][nxt[t]][:2] for t in g], a._wide_left]
            for g in cut(list(hid), False, rows):
                for s, out in zip(g, b.forward([seg(s, hid[s]) for s in g], rewind=True)):
                    got[s].append((hid[s].copy(), out.copy(), calls[s] + [[scripts[t][nxt[t]][:2] for t in g],
                                                                          b._wide_left]))
            for s in hid:
                nxt[s] += 1
        return got

    # the reference: each session alone, from a fresh call-shape state
    reference: dict[int, list] = {}
    for s in range(len(CTXS)):
        a._wide_left = b._wide_left = 0
        reference |= run([s], lambda ready, some, rows: [ready])

    def cutter(r: np.random.Generator):
        """Random calls of 1-4 segments and at most CHUNK rows (the scheduler's cap)."""
        def cut(ready: list[int], some: bool, rows) -> list[list[int]]:
            live = ([s for s in ready if r.random() < 0.7] or ready[:1]) if some else list(ready)
            r.shuffle(live)
            out: list[list[int]] = []
            want = 0
            for s in live:
                if out and len(out[-1]) < want and sum(map(rows, out[-1])) + rows(s) <= CHUNK:
                    out[-1].append(s)
                else:
                    out.append([s])
                    want = int(r.integers(1, 5))
            return out
        return cut

    total = 0
    for sched in range(args.schedules):
        got = run(list(range(len(CTXS))), cutter(np.random.default_rng(1000 + sched)))
        first: list[dict] = []
        for s in range(len(CTXS)):
            for k, ((h, lo, calls), (rh, rlo, _)) in enumerate(zip(got[s], reference[s])):
                dh, dl = _diff(h, rh), _diff(lo, rlo)
                if dh or dl:
                    pos, n, n_logits = scripts[s][k]
                    first.append({"session": s, "step": k, "pos": pos, "rows": n, "n_logits": n_logits,
                                  "hidden_diff": dh, "logits_diff": dl, "calls": calls})
                    break
        total += len(first)
        print(json.dumps({"seed": 1000 + sched, "sessions_differ": len(first), "first": first}), flush=True)
    print(f"{Path(args.model).name} on {a.backend} (pad {a.pad_rows}, wide calls after windows "
          f"{a._sticky_calls}/{b._sticky_calls}, windows {'on' if args.windows else 'off'}): "
          f"{total} of {len(CTXS) * args.schedules} session runs differ from alone", flush=True)
    a.close()
    b.close()
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
