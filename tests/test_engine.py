"""StageEngine on real llama.cpp: sessions, rollback, and bad input.

- Several sessions interleaved on one engine (and several in one ``forward()`` call)
  give exactly the logits each session gives alone on a fresh engine, for the whole
  model and for a 3-stage chain of slices.
- Rollback then re-decode equals a fresh run; ``rewind=True`` does the same in-band.
- Bad input (non-GGUF, truncated GGUF, unsupported architecture, range out of bounds,
  hidden states of the wrong width or dtype, position gaps, too many rows) is a typed
  error with a clear message, leaves the engine usable and leaves no half-written file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from meshnode.engine import (
    ContextOverflowError,
    EngineBusyError,
    EngineInputError,
    EngineConfig,
    ModelLoadError,
    Segment,
    StageEngine,
)
from meshnode.engine.tokenizer import Tokenizer
from meshnode.models.errors import ModelFileError, SliceRangeError, UnsupportedArchitectureError
from meshnode.models.slicer import SliceCache, write_slice

THREADS = 1
COMMON = dict(n_ctx=128, n_batch=64, n_seq_max=4, n_threads=THREADS)


class Chain:
    """Engines for consecutive layer ranges, driven like the pipeline drives them."""

    def __init__(self, paths: Sequence[Path], **kw) -> None:
        n = len(paths)
        self.stages = [
            StageEngine(EngineConfig(p, takes_tokens=(i == 0), has_head=(i == n - 1), **{**COMMON, **kw}))
            for i, p in enumerate(paths)
        ]

    def forward(self, segs: Sequence[Segment], rewind: bool = False) -> list[np.ndarray]:
        """``segs`` carry tokens; returns the final stage's logits per segment."""
        outs: list[np.ndarray] = []
        for i, eng in enumerate(self.stages):
            if i > 0:
                segs = [Segment(s.session, s.pos, hidden=h, n_logits=s.n_logits) for s, h in zip(segs, outs)]
            outs = eng.forward(segs, rewind=rewind)
        return outs

    def rollback(self, session: int, pos: int) -> None:
        for eng in self.stages:
            eng.rollback(session, pos)

    def drop(self, session: int) -> None:
        for eng in self.stages:
            eng.drop(session)

    def close(self) -> None:
        for eng in self.stages:
            eng.close()


def _toks(*ids: int) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


@pytest.fixture(scope="module")
def smol_chains(smollm2, model_store_paths):
    """Paths of the whole model and of a 3-stage split [0,9) [9,21) [21,30)."""
    cache = SliceCache(model_store_paths.ensure())
    return {
        "whole": [smollm2.path],
        "3-stages": [cache.get(smollm2, 0, 9), cache.get(smollm2, 9, 21), cache.get(smollm2, 21, 30)],
    }


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[np.ndarray]:
    tok = Tokenizer(smollm2.path)
    texts = [
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
        "The quick brown fox jumps over the lazy dog. " * 3,
    ]
    out = [np.asarray(tok.encode(t, add_bos=True), dtype=np.int32) for t in texts]
    tok.close()
    return out


# Fixed continuation tokens (not sampled), so every run uses the same schedule.
CONT = [_toks(504, 3725, 28, 198, 1604, 3987, 472, 585), _toks(216, 32, 42, 448, 1003, 5406, 2, 94),
        _toks(30, 2000, 11, 727, 10204, 17, 19, 300)]


def _alone(paths, prompt: np.ndarray, cont: np.ndarray) -> list[np.ndarray]:
    """Logits of one session on a fresh engine: prefill (last row), then one per token."""
    chain = Chain(paths)
    try:
        out = [chain.forward([Segment(7, 0, tokens=prompt, n_logits=1)])[0]]
        pos = len(prompt)
        for t in cont:
            out.append(chain.forward([Segment(7, pos, tokens=_toks(t), n_logits=1)])[0])
            pos += 1
        return out
    finally:
        chain.close()


class Interleaved:
    """Three sessions on one chain; records each session's logits per call."""

    def __init__(self, paths) -> None:
        self.chain = Chain(paths)
        self.sessions = [101, 202, 303]
        self.pos = [0, 0, 0]
        self.got: list[list[np.ndarray]] = [[], [], []]

    def run(self, idx: Sequence[int], rows: Sequence[np.ndarray]) -> None:
        segs = [Segment(self.sessions[i], self.pos[i], tokens=r, n_logits=1) for i, r in zip(idx, rows)]
        for i, logits in zip(idx, self.chain.forward(segs)):
            self.got[i].append(logits)
        for i, r in zip(idx, rows):
            self.pos[i] += len(r)


def _assert_same(got: list[list[np.ndarray]], ref: list[list[np.ndarray]]) -> None:
    for i, (g_steps, r_steps) in enumerate(zip(got, ref)):
        assert len(g_steps) == len(r_steps)
        for step, (g, r) in enumerate(zip(g_steps, r_steps)):
            assert g.shape == r.shape
            assert np.array_equal(g, r), f"session {i} step {step}: max diff {np.max(np.abs(g - r))}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["whole", "3-stages"])
def test_concurrent_sessions_do_not_disturb_each_other(smol_chains, prompts, layout):
    paths = smol_chains[layout]
    ref = [_alone(paths, p, c) for p, c in zip(prompts, CONT)]
    run = Interleaved(paths)
    try:
        run.run([0], [prompts[0]])                              # A prefills alone
        run.run([0], [CONT[0][0:1]])                            # A decodes
        run.run([1, 2], [prompts[1], prompts[2]])               # B and C prefill in one call
        for k in range(1, 4):                                   # A, B, C decode in one call
            run.run([0, 1, 2], [CONT[0][k:k + 1], CONT[1][k - 1:k], CONT[2][k - 1:k]])
        run.run([2, 0], [CONT[2][3:4], CONT[0][4:5]])           # order inside a call changes
        run.run([1], [CONT[1][3:4]])                            # one alone, then the others
        for k in range(5, 8):
            run.run([0, 2], [CONT[0][k:k + 1], CONT[2][k - 1:k]])
        run.run([1], [CONT[1][4:5]])
        run.run([1, 2], [CONT[1][5:6], CONT[2][7:8]])
        run.run([1], [CONT[1][6:7]])
        run.run([1], [CONT[1][7:8]])
    finally:
        run.chain.close()
    _assert_same(run.got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["whole", "3-stages"])
def test_session_slots_are_reused_after_drop(smol_chains, prompts, layout):
    """A dropped session's slot and KV cells serve a new session that equals a fresh run."""
    paths = smol_chains[layout]
    ref = _alone(paths, prompts[2], CONT[2])
    chain = Chain(paths, n_seq_max=2)
    try:
        for s in (1, 2):
            chain.forward([Segment(s, 0, tokens=prompts[s - 1], n_logits=1)])
        chain.drop(1)
        chain.drop(2)
        got = [chain.forward([Segment(3, 0, tokens=prompts[2], n_logits=1)])[0]]
        for k, t in enumerate(CONT[2]):
            got.append(chain.forward([Segment(3, len(prompts[2]) + k, tokens=_toks(t), n_logits=1)])[0])
    finally:
        chain.close()
    _assert_same([got], [ref])


def _drop_while_others_run(paths, prompts) -> list[list[np.ndarray]]:
    run = Interleaved(paths)
    try:
        run.run([0, 1], prompts[:2])
        run.run([2], prompts[2:])
        for k in range(0, 3):
            run.run([0, 1, 2], [CONT[i][k:k + 1] for i in range(3)])
        run.chain.drop(run.sessions[1])                         # B leaves: a hole in the cache
        for k in range(3, 8):
            run.run([0, 2], [CONT[0][k:k + 1], CONT[2][k:k + 1]])
    finally:
        run.chain.close()
    return [run.got[0], run.got[2]]


@pytest.mark.slow
def test_dropping_a_session_under_others_chain_equals_whole_model(smol_chains, prompts):
    """Whatever llama.cpp does with the hole, every stage does the same: the chain still
    equals the whole model run with the same schedule, bit for bit."""
    whole = _drop_while_others_run(smol_chains["whole"], prompts)
    chain = _drop_while_others_run(smol_chains["3-stages"], prompts)
    _assert_same(chain, whole)


@pytest.mark.slow
def test_dropping_a_session_under_others_equals_alone(smol_chains, prompts):
    got = _drop_while_others_run(smol_chains["whole"], prompts)
    ref = [_alone(smol_chains["whole"], prompts[i], CONT[i]) for i in (0, 2)]
    _assert_same(got, [r[: len(g)] for g, r in zip(got, ref)])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["whole", "3-stages"])
def test_rollback_then_redecode_equals_fresh_run(smol_chains, prompts, layout):
    paths = smol_chains[layout]
    prompt, cont = prompts[0], CONT[0]
    fresh = _alone(paths, prompt, cont)
    chain = Chain(paths)
    try:
        n = len(prompt)
        chain.forward([Segment(1, 0, tokens=prompt, n_logits=1)])
        for k, t in enumerate(cont):                      # decode 8
            chain.forward([Segment(1, n + k, tokens=_toks(t), n_logits=1)])
        chain.rollback(1, n + 3)                          # roll back 5
        assert all(eng.next_pos(1) == n + 3 for eng in chain.stages)
        for k in range(3, 8):                             # re-decode them
            logits = chain.forward([Segment(1, n + k, tokens=cont[k:k + 1], n_logits=1)])[0]
            assert np.array_equal(logits, fresh[k + 1]), f"token {k}"

        # A verify batch of 4 with wrong drafts, rolled back in-band by the next window.
        window = _toks(int(cont[7]), 1, 2, 3)
        chain.forward([Segment(1, n + 8, tokens=window, n_logits=4)])
        redo = chain.forward([Segment(1, n + 9, tokens=_toks(5), n_logits=1)], rewind=True)[0]
    finally:
        chain.close()

    # A fresh engine that never saw the drafts.
    ref = Chain(paths)
    try:
        ref.forward([Segment(1, 0, tokens=prompt, n_logits=1)])
        for k, t in enumerate(cont):
            ref.forward([Segment(1, n + k, tokens=_toks(t), n_logits=1)])
        ref.forward([Segment(1, n + 8, tokens=_toks(int(cont[7])), n_logits=1)])
        want = ref.forward([Segment(1, n + 9, tokens=_toks(5), n_logits=1)])[0]
    finally:
        ref.close()
    assert np.array_equal(redo, want)


# --------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def smol_stages(smol_chains):
    """A loaded first and middle stage of SmolLM2 for input checks."""
    first, middle, _final = smol_chains["3-stages"]
    a = StageEngine(EngineConfig(first, takes_tokens=True, has_head=False, **COMMON))
    b = StageEngine(EngineConfig(middle, takes_tokens=False, has_head=False, **COMMON))
    yield a, b
    a.close()
    b.close()


@pytest.mark.slow
def test_hidden_states_of_wrong_width_or_dtype(smol_stages):
    first, middle = smol_stages
    assert middle.n_embd == 576
    good = first.forward([Segment(1, 0, tokens=_toks(1, 2, 3))])[0]
    assert good.shape == (3, 576) and good.dtype == np.float32
    for bad in (good[:, :-1], np.zeros((3, 577), np.float32), good[0], good[None]):
        with pytest.raises(EngineInputError, match="shape"):
            middle.forward([Segment(1, 0, hidden=np.ascontiguousarray(bad))])
    for dtype in (np.float16, np.float64, np.int32):
        with pytest.raises(EngineInputError, match="float32"):
            middle.forward([Segment(1, 0, hidden=good.astype(dtype))])
    with pytest.raises(EngineInputError, match="hidden states, not token ids"):
        middle.forward([Segment(1, 0, tokens=_toks(1))])
    with pytest.raises(EngineInputError, match="token ids, not hidden states"):
        first.forward([Segment(2, 0, hidden=good)])
    # Nothing was changed by the refusals: the middle stage still starts at position 0.
    assert middle.next_pos(1) == 0
    out = middle.forward([Segment(1, 0, hidden=good)])[0]
    assert out.shape == (3, 576) and np.isfinite(out).all()
    first.drop(1)
    middle.drop(1)


@pytest.mark.slow
def test_positions_rows_and_sessions_are_checked(smol_stages):
    first, _ = smol_stages
    first.forward([Segment(5, 0, tokens=_toks(1, 2))])
    with pytest.raises(EngineInputError, match="position 3 given, 2 expected"):
        first.forward([Segment(5, 3, tokens=_toks(4))])       # a gap
    with pytest.raises(EngineInputError, match="position 1 given, 2 expected"):
        first.forward([Segment(5, 1, tokens=_toks(4))])       # overlap without rollback
    with pytest.raises(EngineInputError, match="at most 64"):
        first.forward([Segment(6, 0, tokens=np.ones(65, np.int32))])
    with pytest.raises(EngineInputError, match="at most 64"):
        first.forward([Segment(6, 0, tokens=np.ones(40, np.int32)), Segment(7, 0, tokens=np.ones(40, np.int32))])
    with pytest.raises(EngineInputError, match="twice"):
        first.forward([Segment(5, 2, tokens=_toks(1)), Segment(5, 3, tokens=_toks(1))])
    with pytest.raises(EngineInputError, match="token id out of range"):
        first.forward([Segment(6, 0, tokens=_toks(first.n_vocab))])
    with pytest.raises(EngineInputError, match="empty"):
        first.forward([Segment(6, 0, tokens=np.zeros(0, np.int32))])
    with pytest.raises(EngineInputError, match="n_logits"):
        first.forward([Segment(6, 0, tokens=_toks(1), n_logits=2)])
    with pytest.raises(EngineInputError, match="rollback position"):
        first.rollback(5, -1)
    first.forward([Segment(5, 2, tokens=np.ones(64, np.int32))])
    with pytest.raises(ContextOverflowError):  # n_ctx = 128 positions per session
        first.forward([Segment(5, 66, tokens=np.ones(63, np.int32))])
    # The engine is still usable and session 5 continues where it was.
    assert first.next_pos(5) == 66
    assert first.forward([Segment(5, 66, tokens=_toks(1))])[0].shape == (1, 576)
    first.drop(5)


@pytest.mark.slow
def test_session_slots_run_out(smollm2):
    with StageEngine(EngineConfig(smollm2.path, **{**COMMON, "n_seq_max": 2})) as eng:
        eng.forward([Segment(1, 0, tokens=_toks(1)), Segment(2, 0, tokens=_toks(1))])
        with pytest.raises(EngineBusyError):
            eng.forward([Segment(3, 0, tokens=_toks(1))])
        eng.drop(1)
        assert eng.forward([Segment(3, 0, tokens=_toks(1), n_logits=1)])[0].shape == (1, eng.n_vocab)


@pytest.mark.slow
@pytest.mark.parametrize("keep", [None, 5])
def test_copied_session_continues_like_a_fresh_one(smollm2, prompts, keep):
    """SessionCopy (requests with n > 1): with one KV stream per session llama.cpp copies
    only whole streams, so the engine copies all and trims; the copy then decodes exactly
    what a session prefilled from scratch does."""
    prompt = prompts[0]
    n = len(prompt) if keep is None else keep
    with StageEngine(EngineConfig(smollm2.path, **COMMON)) as eng:
        eng.forward([Segment(1, 0, tokens=prompt)])
        eng.copy(1, 2, n)
        got = eng.forward([Segment(2, n, tokens=_toks(42, 43), n_logits=2)])[0]
        eng.forward([Segment(3, 0, tokens=prompt[:n])])
        ref = eng.forward([Segment(3, n, tokens=_toks(42, 43), n_logits=2)])[0]
        assert np.array_equal(got, ref)
        with pytest.raises(EngineInputError):
            eng.copy(1, 2, n)            # dst in use
        with pytest.raises(EngineInputError):
            eng.copy(1, 4, len(prompt) + 1)   # more than src holds


@pytest.mark.slow
def test_engine_refuses_a_text_file(tmp_path):
    junk = tmp_path / "notes.gguf"
    junk.write_text("this is a text file, not a model\n" * 100)
    with pytest.raises(ModelLoadError, match="notes.gguf"):
        StageEngine(EngineConfig(junk, n_threads=THREADS))
    with pytest.raises(ModelLoadError, match="not found"):
        StageEngine(EngineConfig(tmp_path / "missing.gguf", n_threads=THREADS))


@pytest.mark.slow
@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_engine_refuses_a_truncated_gguf(synthetic_gguf, tmp_path, keep):
    src = synthetic_gguf("whole.gguf", architecture="qwen3")
    data = src.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        StageEngine(EngineConfig(cut, n_threads=THREADS))


@pytest.mark.slow
def test_engine_refuses_an_unknown_architecture(synthetic_gguf):
    src = synthetic_gguf("odd.gguf", architecture="not-an-arch")
    with pytest.raises(ModelLoadError, match="odd.gguf"):
        StageEngine(EngineConfig(src, n_threads=THREADS))


def test_slicer_refuses_unsupported_architecture_and_leaves_nothing(synthetic_gguf, tmp_path):
    src = synthetic_gguf("mamba.gguf", architecture="mamba")
    dest = tmp_path / "out" / "slice.gguf"
    dest.parent.mkdir()
    with pytest.raises(UnsupportedArchitectureError, match="'mamba' is not supported"):
        write_slice(src, 0, 2, dest, keep_embedding=True, keep_head=False)
    assert list(dest.parent.iterdir()) == []


@pytest.mark.parametrize(("a", "b"), [(0, 5), (3, 3), (4, 2), (-1, 2)])
def test_slicer_refuses_range_out_of_bounds_and_leaves_nothing(synthetic_gguf, tmp_path, a, b):
    src = synthetic_gguf("llama.gguf", architecture="llama", n_layer=4)
    dest = tmp_path / "out" / "slice.gguf"
    dest.parent.mkdir()
    with pytest.raises(SliceRangeError, match=r"outside the llama\.gguf's blocks \[0, 4\)"):
        write_slice(src, a, b, dest, keep_embedding=True, keep_head=False)
    assert list(dest.parent.iterdir()) == []


@pytest.mark.parametrize("what", ["text", "truncated"])
def test_slicer_refuses_bad_source_and_leaves_nothing(synthetic_gguf, tmp_path, what):
    if what == "text":
        src = tmp_path / "src.gguf"
        src.write_text("hello\n" * 100)
    else:
        whole = synthetic_gguf("whole.gguf")
        src = tmp_path / "src.gguf"
        src.write_bytes(whole.read_bytes()[:-1000])
    dest = tmp_path / "out" / "slice.gguf"
    dest.parent.mkdir()
    with pytest.raises(ModelFileError, match="src.gguf"):
        write_slice(src, 0, 2, dest, keep_embedding=True, keep_head=False)
    assert list(dest.parent.iterdir()) == []


# -- threads and exactness ------------------------------------------------------------
#
# With an f16 KV cache and more than one thread, llama.cpp's CPU flash attention computes a
# lone row through a split-KV path once the KV view reaches 512 cells; rows of a multi-row
# batch take another path and round differently. The default q8_0 cache takes neither
# path, so one-row steps equal verify windows at the default thread count.


def _one_row_steps_vs_windows(model: Path, n_threads: int | None, decode_threads: int | None,
                              **kw) -> float:
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 30000, 600).astype(np.int32)   # past 512 KV cells
    tail = rng.integers(100, 30000, 20).astype(np.int32)
    outs = []
    for window in (1, 5):
        with StageEngine(EngineConfig(model, n_ctx=1024, n_batch=64, n_seq_max=1,
                                    n_threads=n_threads, decode_threads=decode_threads, **kw)) as e:
            for s in range(0, len(prompt), 64):
                e.forward([Segment(0, s, tokens=prompt[s:s + 64], n_logits=0 if s + 64 < len(prompt) else 1)])
            rows = []
            for i in range(0, len(tail), window):
                chunk = tail[i:i + window]
                rows.extend(e.forward([Segment(0, len(prompt) + i, tokens=chunk, n_logits=len(chunk))])[0])
            outs.append(np.asarray(rows))
    return float(np.abs(outs[0] - outs[1]).max())


@pytest.mark.slow
def test_one_token_steps_on_one_thread_equal_verify_windows_at_long_context(smollm2):
    assert _one_row_steps_vs_windows(smollm2.path, n_threads=2, decode_threads=1, kv_type="f16") == 0.0


@pytest.mark.slow
def test_one_token_steps_equal_verify_windows_at_default_threads(smollm2):
    """The defaults are exact: plain steps equal speculative verify windows past 512 cells,
    on every thread (the f16 cache is the control: it differs there)."""
    assert _one_row_steps_vs_windows(smollm2.path, n_threads=2, decode_threads=None) == 0.0
    assert _one_row_steps_vs_windows(smollm2.path, n_threads=2, decode_threads=None, kv_type="f16") > 0.0


# -- batch invariance: 16 sessions together equal each alone ---------------------------

N_SESSIONS = 16


def _greedy(chain: Chain, prompts: Sequence[np.ndarray], together: bool, steps: int) -> list[list[int]]:
    """Greedy tokens of every prompt, run one at a time or all together (prefills staggered
    in groups of 4 beside the decoding sessions, sessions dropped as they finish)."""
    toks: dict[int, list[int]] = {}

    def step(segs: list[Segment]) -> None:
        for seg, logits in zip(segs, chain.forward(segs)):
            toks.setdefault(seg.session, []).append(int(logits[-1].argmax()))
            if len(toks[seg.session]) == steps:
                chain.drop(seg.session)

    def decoding() -> list[Segment]:
        return [Segment(i, len(prompts[i]) + len(t) - 1, tokens=_toks(t[-1]), n_logits=1)
                for i, t in toks.items() if len(t) < steps]

    groups = [[i] for i in range(len(prompts))] if not together else \
        [list(range(g, g + 4)) for g in range(0, len(prompts), 4)]
    for group in groups:
        step([Segment(i, 0, tokens=prompts[i], n_logits=1) for i in group]
             + (decoding() if together else []))
        while not together and decoding():
            step(decoding())
    while decoding():
        step(decoding())
    return [toks[i] for i in range(len(prompts))]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["whole", "3-stages"])
def test_sixteen_sessions_together_equal_each_alone(smol_chains, layout):
    """A greedy answer does not depend on what else the engine runs (default threads)."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 40000, int(rng.integers(6, 30))).astype(np.int32) for _ in range(N_SESSIONS)]
    runs = []
    for together in (False, True):
        chain = Chain(smol_chains[layout], n_ctx=256, n_batch=256, n_seq_max=N_SESSIONS, n_threads=None)
        try:
            runs.append(_greedy(chain, prompts, together, steps=16))
            assert all(not eng.sessions() for eng in chain.stages)
        finally:
            chain.close()
    alone, together = runs
    assert together == alone


# Sessions a, b, c (decoded together, on prompts 0, 1, 2), an idle one and two fillers,
# created in an order that scatters them: ids fill0 0, a 1, idle 2, b 3, fill4 4, c 5.
_A, _B, _C, _IDLE, _FILL0, _FILL4 = 1, 2, 3, 4, 50, 54


def _scatter(chain: Chain, prompts) -> None:
    for s, p in ((_FILL0, 0), (_A, 0), (_IDLE, 1), (_B, 1), (_FILL4, 2), (_C, 2)):
        chain.forward([Segment(s, 0, tokens=prompts[p], n_logits=1)])


def _decode_together(chain: Chain, prompts, check) -> list[list[np.ndarray]]:
    """CONT fed to a, b and c in one forward per token, ``check(engine, segs, seq ids)``
    after each; the logits of each session."""
    got: list[list[np.ndarray]] = [[], [], []]
    for k, t in enumerate(zip(*CONT)):
        segs = [Segment(s, len(prompts[i]) + k, tokens=_toks(t[i]), n_logits=1)
                for i, s in enumerate((_A, _B, _C))]
        for i, logits in enumerate(chain.forward(segs)):
            got[i].append(logits)
        for eng in chain.stages:
            check(eng, segs, [eng._seq_of[s.session] for s in segs])
    return got


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["whole", "3-stages"])
@pytest.mark.parametrize("free_id", [True, False], ids=["swap-through-free-id", "swap-through-host"])
def test_scattered_sessions_are_packed_into_one_call_and_stay_exact(smol_chains, prompts, layout, free_id):
    """llama.cpp runs each run of consecutive sequence ids as its own micro-batch, so a
    batch of sessions on scattered ids would cost one call per session. The engine
    moves them into one window of ids first, trading places with an idle session there
    (through a free id, or with no id free through host memory); every moved session,
    idle ones included, answers as if alone."""
    paths = smol_chains[layout]
    refs = [_alone(paths, prompts[i], CONT[i]) for i in range(3)]
    chain = Chain(paths, n_seq_max=6)

    def one_call(eng, segs, seqs):   # the three now sit on consecutive ids: one llama_decode
        assert max(seqs) - min(seqs) == 2 and len(eng._calls(segs, seqs)) == 1

    try:
        _scatter(chain, prompts)
        if free_id:
            chain.drop(_FILL4)                              # one free id, outside the batch's window
        for eng in chain.stages:
            assert sorted(eng._seq_of[s] for s in (_A, _B, _C)) == [1, 3, 5]
        got = _decode_together(chain, prompts, one_call)
        idle_got = [chain.forward([Segment(_IDLE, len(prompts[1]) + k, tokens=_toks(t), n_logits=1)])[0]
                    for k, t in enumerate(CONT[1])]
    finally:
        chain.close()
    _assert_same(got, [r[1:] for r in refs])
    _assert_same([idle_got], [refs[1][1:]])


@pytest.mark.slow
def test_an_engine_that_does_not_pack_leaves_scattered_sessions_in_place_and_stays_exact(smol_chains, prompts):
    """What a GPU engine does (EngineConfig.pack_sessions, None: off with layers on a GPU,
    where moving a stream costs a graph reserve or a host round trip): the batch's
    sessions keep their ids, llama.cpp runs one micro-batch per run of consecutive ids,
    and every session answers as if alone."""
    paths = smol_chains["3-stages"]
    refs = [_alone(paths, prompts[i], CONT[i]) for i in range(3)]
    chain = Chain(paths, n_seq_max=6, pack_sessions=False)

    def left_in_place(eng, segs, seqs):
        assert seqs == [1, 3, 5] and len(eng._calls(segs, seqs)) == 3

    try:
        _scatter(chain, prompts)
        got = _decode_together(chain, prompts, left_in_place)
    finally:
        chain.close()
    _assert_same(got, [r[1:] for r in refs])


@pytest.mark.slow
def test_packing_waits_for_a_queued_session_copy(smol_chains, prompts):
    """A session copy's data moves only at the next llama_decode: a batch right after it
    that would need a swap through host memory is run unpacked, and every session, the
    copy and its source included, stays exact."""
    paths = smol_chains["whole"]
    refs = [_alone(paths, prompts[i], CONT[i]) for i in range(2)]
    chain = Chain(paths, n_seq_max=4)
    a, src, b, dst = 1, 2, 3, 4
    try:
        for s, p in ((a, 0), (src, 1), (b, 0)):
            chain.forward([Segment(s, 0, tokens=prompts[p], n_logits=1)])
        for eng in chain.stages:
            eng.copy(src, dst, len(prompts[1]))         # dst on the last id, its data queued
        got: list[list[np.ndarray]] = [[], [], []]
        for k in range(len(CONT[0])):
            segs = [Segment(a, len(prompts[0]) + k, tokens=_toks(CONT[0][k]), n_logits=1),
                    Segment(b, len(prompts[0]) + k, tokens=_toks(CONT[0][k]), n_logits=1),
                    Segment(dst, len(prompts[1]) + k, tokens=_toks(CONT[1][k]), n_logits=1)]
            for i, logits in enumerate(chain.forward(segs)):
                got[i].append(logits)
        src_got = [chain.forward([Segment(src, len(prompts[1]) + k, tokens=_toks(t), n_logits=1)])[0]
                   for k, t in enumerate(CONT[1])]
    finally:
        chain.close()
    _assert_same(got, [refs[0][1:], refs[0][1:], refs[1][1:]])
    _assert_same([src_got], [refs[1][1:]])
