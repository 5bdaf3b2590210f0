"""Certify that chained slices reproduce the whole model exactly.

Runs, in one process, the whole model and the chain of slices for the given split
points on a fixed prompt: a prefill, greedy decode steps, one verify batch of 4 tokens
and a rollback followed by a re-decode. At every step it compares each boundary's hidden
states (whole model tapped at ``l_out-{b-1}`` vs the output of the slice ending at b)
and the final logits, and checks the greedy tokens agree. Exact means a max absolute
difference of 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from meshnode.engine import EngineConfig, Segment, StageEngine
from meshnode.engine.tokenizer import Tokenizer
from meshnode.errors import MeshnodeError
from meshnode.limits import gpu_bucket_drafts

log = logging.getLogger(__name__)

PROMPT = (
    "<|im_start|>user\nWrite a Python function that returns the n-th Fibonacci number, "
    "then explain how it works in two sentences.<|im_end|>\n<|im_start|>assistant\n"
)


MAX_PROMPT_TOKENS = 1024


class CertifyError(MeshnodeError):
    pass


@dataclass
class Boundary:
    layer: int
    max_abs_diff: float = 0.0


@dataclass
class CertifyReport:
    model: str
    n_layers: int
    splits: list[int]
    boundaries: list[Boundary]
    logits_max_abs_diff: float = 0.0
    greedy_match: bool = True
    whole_tokens: list[int] = field(default_factory=list)
    split_tokens: list[int] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return (self.greedy_match and self.logits_max_abs_diff == 0.0
                and all(b.max_abs_diff == 0.0 for b in self.boundaries))

    def to_json(self) -> dict:
        d = asdict(self)
        d["exact"] = self.exact
        return d


def parse_splits(text: str, n_layers: int) -> list[int]:
    try:
        splits = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise CertifyError(f"--splits must be comma-separated layer numbers, got {text!r}") from None
    if not splits:
        raise CertifyError("--splits needs at least one layer number")
    bad = [s for s in splits if not 0 < s < n_layers]
    if bad:
        raise CertifyError(f"split points must lie in 1..{n_layers - 1}; got {bad}")
    return splits


def certify(
    model_path: Path,
    splits: Sequence[int],
    slice_for: Callable[[int, int], Path],
    *,
    n_decode: int = 16,
    n_threads: int | None = None,
    prompt: str = PROMPT,
    gpu_layers: int = 0,
    flash_attn: bool | None = None,
) -> CertifyReport:
    """Compare the whole model with its slices at ``splits``.

    ``slice_for(start, end)`` returns the path of the slice GGUF for [start, end).
    """
    tok = Tokenizer(model_path)
    tokens = np.asarray(tok.encode(prompt, add_bos=True), dtype=np.int32)
    tok.close()
    n_batch = 64  # the prompt is fed in chunks of n_batch (a byte-level vocabulary needs several)
    if len(tokens) > MAX_PROMPT_TOKENS:
        raise CertifyError(f"certification prompt too long ({len(tokens)} tokens, at most {MAX_PROMPT_TOKENS})")
    n_ctx = max(256, len(tokens) + n_decode + 8)

    common = dict(n_ctx=n_ctx, n_batch=n_batch, n_seq_max=1, n_threads=n_threads,
                  gpu_layers=gpu_layers, flash_attn=flash_attn)
    whole = StageEngine(EngineConfig(model_path, taps=tuple(b - 1 for b in splits), **common))
    n_layers = whole.n_layer
    bounds = [0, *splits, n_layers]
    ranges = list(zip(bounds[:-1], bounds[1:]))
    stages: list[StageEngine] = []
    try:
        for i, (a, b) in enumerate(ranges):
            stages.append(StageEngine(EngineConfig(
                slice_for(a, b), takes_tokens=(i == 0), has_head=(i == len(ranges) - 1), **common)))
        report = CertifyReport(model=model_path.name, n_layers=n_layers, splits=list(splits),
                               boundaries=[Boundary(layer=b) for b in splits])

        def step(name: str, pos: int, rows: np.ndarray, n_logits: int) -> np.ndarray:
            """Run ``rows`` through both paths; return the split path's logits."""
            n = rows.shape[0]
            w_logits = whole.forward([Segment(0, pos, tokens=rows, n_logits=n_logits)])[0]
            h: np.ndarray | None = None
            for i, eng in enumerate(stages):
                seg = (Segment(0, pos, tokens=rows, n_logits=0) if i == 0
                       else Segment(0, pos, hidden=h, n_logits=n_logits if eng.has_head else 0))
                h = eng.forward([seg])[0]
                if not eng.has_head:
                    ref = whole.tapped(ranges[i][1] - 1, n)
                    d = float(np.max(np.abs(ref - h))) if n else 0.0
                    bnd = report.boundaries[i]
                    bnd.max_abs_diff = max(bnd.max_abs_diff, d)
            assert h is not None
            d = float(np.max(np.abs(w_logits - h))) if n_logits else 0.0
            report.logits_max_abs_diff = max(report.logits_max_abs_diff, d)
            report.steps.append(f"{name}: {n} rows, logits diff {d:g}" if n_logits
                                else f"{name}: {n} rows (no logits)")
            wa, sa = w_logits.argmax(axis=-1), h.argmax(axis=-1)
            report.whole_tokens.extend(int(t) for t in wa)
            report.split_tokens.extend(int(t) for t in sa)
            if not np.array_equal(wa, sa):
                report.greedy_match = False
            return h

        # 1. prefill, in chunks of n_batch rows; logits for the last row only
        pos = 0
        chunks = [tokens[i:i + n_batch] for i in range(0, len(tokens), n_batch)]
        for k, chunk in enumerate(chunks):
            last = k == len(chunks) - 1
            name = "prefill" if len(chunks) == 1 else f"prefill {k + 1}/{len(chunks)}"
            logits = step(name, pos, chunk, 1 if last else 0)
            pos += len(chunk)
        nxt = int(logits[-1].argmax())
        generated = [nxt]
        # 2. greedy decode
        for k in range(n_decode):
            logits = step(f"decode {k}", pos, np.asarray([nxt], dtype=np.int32), 1)
            pos += 1
            nxt = int(logits[-1].argmax())
            generated.append(nxt)
        # 3. a 4-token verify batch: [last, d1, d2, d3] with drafts partly wrong
        drafts = [generated[-1], generated[-2], generated[-3]]
        window = np.asarray([nxt, *drafts], dtype=np.int32)
        step("verify 4", pos, window, 4)
        pos += 4
        # 4. rollback the 3 drafts on every engine, then re-decode one token
        pos -= 3
        for eng in (whole, *stages):
            eng.rollback(0, pos)
        step("rollback+decode", pos, np.asarray([drafts[0]], dtype=np.int32), 1)
        return report
    finally:
        whole.close()
        for eng in stages:
            eng.close()


# ---- batch schedule: one-row steps against verify windows ---------------------------

SCHEDULE_CONTEXTS = (16, 200, 490, 600)
SCHEDULE_WINDOWS = (2, 4, 8, 16, 32)
SCHEDULE_STEPS = 32


@dataclass
class ScheduleCase:
    context: int
    window: int
    max_abs_diff: float = 0.0
    first_diff_row: int | None = None   # first position (after the context) that differed
    greedy_match: bool = True


@dataclass
class TogetherCase:
    """One session per context decoding its steps in the same forwards, against each
    alone: what a node serving several requests at once needs (docs/engine.md,
    "Sessions together")."""
    contexts: list[int]
    max_abs_diff: float = 0.0
    sessions_differ: int = 0
    greedy_match: bool = True


@dataclass
class ScheduleReport:
    """One model, one engine: do multi-row windows give exactly the logits of one-row
    steps? What exact speculation needs (a verify window must reproduce plain decoding).
    And do sessions decoded together give each one's logits alone (``together``)?"""

    model: str
    backend: str
    gpu_layers: int
    cases: list[ScheduleCase] = field(default_factory=list)
    together: TogetherCase | None = None

    @property
    def exact(self) -> bool:
        t = self.together
        return (all(c.max_abs_diff == 0.0 and c.greedy_match for c in self.cases)
                and (t is None or (t.max_abs_diff == 0.0 and t.greedy_match)))

    @property
    def max_abs_diff(self) -> float:
        return max([c.max_abs_diff for c in self.cases] + ([self.together.max_abs_diff] if self.together else []),
                   default=0.0)

    def to_json(self) -> dict:
        d = asdict(self)
        d["exact"] = self.exact
        d["max_abs_diff"] = self.max_abs_diff
        return d


def schedule_windows(ctx_len: int, n_steps: int, window: int, backend: str, pad_rows: int) -> list[tuple[int, int]]:
    """The (offset, rows) of the windows that cover ``n_steps`` steps after ``ctx_len``
    tokens: ``window`` rows each, on a GPU cut where a route cuts them (at the KV buckets
    of :func:`meshnode.limits.gpu_bucket_drafts`)."""
    out: list[tuple[int, int]] = []
    a = 0
    while a < n_steps:
        n = min(window, n_steps - a)
        if backend != "cpu":
            n = min(n, 1 + gpu_bucket_drafts(ctx_len + a, pad_rows))
        out.append((a, n))
        a += n
    return out


def schedule_check(
    model_path: Path,
    *,
    contexts: Sequence[int] = SCHEDULE_CONTEXTS,
    windows: Sequence[int] = SCHEDULE_WINDOWS,
    n_steps: int = SCHEDULE_STEPS,
    n_threads: int | None = None,
    decode_threads: int | None = None,
    gpu_layers: int = 0,
    flash_attn: bool | None = None,
    progress: Callable[[str], None] | None = None,
) -> ScheduleReport:
    """Feed the same ``n_steps`` tokens after each context length twice: as one-row
    steps, then as windows of each size in ``windows`` (rolled back in between), and
    compare every row's logits. On a GPU the windows are cut where a route cuts them, at
    the KV buckets of :func:`meshnode.limits.gpu_bucket_drafts` (one of the default
    contexts, 490, makes the steps cross one). A fixed pseudo-random token stream stands in for text
    (it exercises the same kernels; what matters is that both schedules see it).

    Each context is a session of its own; with two or more contexts the sessions then
    also take their one-row steps together, one ``forward`` of all of them per step, and
    every row is compared with the same session's step alone (``together``)."""
    if not contexts or not windows or min(contexts) < 1 or min(windows) < 2:
        raise CertifyError("contexts must be >= 1 and windows >= 2")
    n_batch = 64
    if max(windows) > n_batch:
        raise CertifyError(f"windows must be at most {n_batch} rows")
    n_ctx = max(contexts) + n_steps + 8
    ctxs = sorted(set(contexts))
    engine = StageEngine(EngineConfig(model_path, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=len(ctxs),
                                      n_threads=n_threads, decode_threads=decode_threads,
                                      gpu_layers=gpu_layers, flash_attn=flash_attn))
    try:
        rng = np.random.default_rng(0)
        stream = rng.integers(0, engine.n_vocab, size=n_ctx, dtype=np.int32)
        report = ScheduleReport(model_path.name, engine.backend, engine.gpu_layers)
        refs = []
        for k, ctx_len in enumerate(ctxs):     # session k holds context ctxs[k]
            engine.run_session(k, 0, stream[:ctx_len], n_logits=1)
            steps = stream[ctx_len:ctx_len + n_steps]
            ref = np.stack([engine.forward([Segment(k, ctx_len + i, tokens=steps[i:i + 1], n_logits=1)])[0][0]
                            for i in range(n_steps)])
            refs.append(ref)
            for w in windows:
                engine.rollback(k, ctx_len)
                got = []
                for a, n in schedule_windows(ctx_len, n_steps, w, engine.backend, engine.pad_rows):
                    rows = steps[a:a + n]
                    got.append(engine.forward([Segment(k, ctx_len + a, tokens=rows, n_logits=n)])[0])
                g = np.concatenate(got)
                diff = np.max(np.abs(g - ref), axis=1)
                case = ScheduleCase(ctx_len, w, float(diff.max()),
                                    int(np.flatnonzero(diff)[0]) if diff.any() else None,
                                    bool(np.array_equal(g.argmax(axis=1), ref.argmax(axis=1))))
                report.cases.append(case)
                if progress is not None:
                    progress(f"context {ctx_len}, window {w}: max |diff| {case.max_abs_diff:g}")
        if len(ctxs) > 1:
            report.together = _together(engine, ctxs, stream, n_steps, refs)
            if progress is not None:
                progress(f"{len(ctxs)} sessions together: max |diff| {report.together.max_abs_diff:g}")
        return report
    finally:
        engine.close()


def _together(engine: StageEngine, ctxs: list[int], stream: np.ndarray, n_steps: int,
              refs: list[np.ndarray]) -> TogetherCase:
    """Session k (at context ``ctxs[k]``) takes its ``n_steps`` one-row steps in the same
    forwards as every other session; its rows against ``refs[k]``, its steps alone."""
    for k, c in enumerate(ctxs):
        engine.rollback(k, c)
    got: list[list[np.ndarray]] = [[] for _ in ctxs]
    for i in range(n_steps):
        outs = engine.forward([Segment(k, c + i, tokens=stream[c + i:c + i + 1], n_logits=1)
                               for k, c in enumerate(ctxs)])
        for k, out in enumerate(outs):
            got[k].append(out[0])
    diffs = [float(np.max(np.abs(np.stack(g) - r))) for g, r in zip(got, refs)]
    match = all(np.array_equal(np.stack(g).argmax(axis=1), r.argmax(axis=1)) for g, r in zip(got, refs))
    return TogetherCase(list(ctxs), max(diffs), sum(d > 0 for d in diffs), match)
