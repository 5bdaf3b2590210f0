"""DraftModelProposer: greedy drafts from a draft model, KV kept consistent; vocab check."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from meshnode.engine import EngineConfig, Segment, StageEngine  # noqa: E402
from meshnode.spec.acceptance import verify_greedy  # noqa: E402
from meshnode.spec.draft import (  # noqa: E402
    DraftModelProposer,
    DraftVocabMismatch,
    check_vocab,
    read_gguf_vocab,
)

N_BATCH = 32  # batch invariance (docs/engine.md): identical logits whatever the schedule

CODE_PROMPT = (
    "<|im_start|>user\nWrite a Python function that returns the n-th Fibonacci number "
    "iteratively.<|im_end|>\n<|im_start|>assistant\n```python\ndef fibonacci(n):\n"
)


def _engine(path: Path, n_seq_max: int = 1) -> StageEngine:
    return StageEngine(EngineConfig(path, n_ctx=512, n_batch=N_BATCH, n_seq_max=n_seq_max, n_threads=1))


def _greedy(engine: StageEngine, prompt: list[int], n: int, session: int = 7) -> list[int]:
    """Plain greedy decoding, one token per step (the reference output)."""
    logits = engine.run_session(session, 0, np.asarray(prompt, dtype=np.int32), n_logits=1)
    out = [int(np.argmax(logits[-1]))]
    while len(out) < n:
        pos = len(prompt) + len(out) - 1
        row = engine.forward([Segment(session, pos, tokens=np.asarray(out[-1:], dtype=np.int32),
                                      n_logits=1)])[0]
        out.append(int(np.argmax(row[-1])))
    engine.drop(session)
    return out


def _speculate(target: StageEngine, draft: DraftModelProposer, prompt: list[int], n: int,
               k: int, session: int = 8) -> tuple[list[int], int, int]:
    """Greedy speculative decoding: target verifies [last, d1..dk] in one batch.

    Returns (tokens, proposed, accepted).
    """
    logits = target.run_session(session, 0, np.asarray(prompt, dtype=np.int32), n_logits=1)
    out = [int(np.argmax(logits[-1]))]
    draft.reset(prompt)
    draft.accept(out)
    proposed = accepted = 0
    while len(out) < n:
        drafts = draft.propose(out[-1:], k)
        pos = len(prompt) + len(out) - 1
        rows = np.asarray([out[-1], *drafts], dtype=np.int32)
        verify = target.forward([Segment(session, pos, tokens=rows, n_logits=len(rows))],
                                rewind=True)[0]
        argmax = [int(i) for i in np.argmax(verify, axis=1)]
        m = verify_greedy(argmax, drafts)
        emitted = [*drafts[:m], argmax[m]]
        # drop the rejected rows from the target's cache: next window starts after `emitted`
        target.rollback(session, pos + 1 + m)
        proposed += len(drafts)
        accepted += m
        out.extend(emitted)
        draft.accept(emitted)
    target.drop(session)
    return out[:n], proposed, accepted


@pytest.fixture(scope="module")
def smol_path(smollm2) -> Path:
    return Path(smollm2.path)


@pytest.fixture(scope="module")
def smol_prompt(smol_path: Path) -> list[int]:
    from meshnode.engine.tokenizer import Tokenizer

    tok = Tokenizer(smol_path)
    try:
        return tok.encode(CODE_PROMPT, add_bos=False)
    finally:
        tok.close()


# ---- with the real model ---------------------------------------------------------------------

@pytest.mark.slow
def test_draft_equal_to_target_is_always_accepted(smol_path: Path, smol_prompt: list[int]):
    target = _engine(smol_path, n_seq_max=2)
    with target, DraftModelProposer(_engine(smol_path), owns_engine=True) as draft:
        reference = _greedy(target, smol_prompt, 40)
        out, proposed, accepted = _speculate(target, draft, smol_prompt, 40, k=4)
        assert out == reference
        assert proposed > 0 and accepted == proposed  # 100 % acceptance
        stats = draft.stats
        # everything accepted: every context token is decoded exactly once, none twice
        assert stats.rows <= len(smol_prompt) + len(out)
        print(f"\ndraft == target: {accepted}/{proposed} accepted, "
              f"{len(out)} tokens, draft rows decoded {stats.rows} in {stats.calls} calls")


@pytest.mark.slow
def test_partial_acceptance_keeps_kv_consistent_real_model(smol_path: Path, smol_prompt: list[int]):
    _check_consistency(smol_path, smol_prompt, cycles=10, seed=1)


# ---- with a random-weight model (seconds, but llama.cpp loads it: slow) ----------------------

def _check_consistency(path: Path, prompt: list[int], *, cycles: int, seed: int) -> None:
    """Random partial acceptances; after each, proposals equal a fresh draft's on the context."""
    rng = random.Random(seed)
    shared = StageEngine(EngineConfig(path, n_ctx=512, n_batch=N_BATCH, n_seq_max=2, n_threads=1))
    with shared:
        draft = DraftModelProposer(shared, session=0)
        fresh = DraftModelProposer(shared, session=1)
        draft.reset(prompt)
        n_vocab = shared.n_vocab
        for _ in range(cycles):
            k = rng.randint(1, 6)
            drafts = draft.propose([], k)
            assert len(drafts) == k
            before = draft.stats
            m = rng.randint(0, k)
            bonus = rng.randrange(n_vocab)
            if m < k and bonus == drafts[m]:
                bonus = (bonus + 1) % n_vocab
            draft.accept([*drafts[:m], bonus])
            nxt = draft.propose([], 3)
            after = draft.stats
            # catch-up feeds only the accepted tokens not yet cached (d_k when all k were
            # accepted, then the bonus) in one call with one logits row; the probe of 3 adds
            # at most 2 single-row calls (fewer when its drafts were cached already)
            rows = after.rows - before.rows
            calls = after.calls - before.calls
            assert 1 <= rows <= (2 if m == k else 1) + 2
            assert calls <= 3 and after.logit_rows - before.logit_rows == calls
            fresh.reset(list(draft.context))
            assert fresh.propose([], 3) == nxt
        fresh.close()
        draft.close()


@pytest.mark.slow
def test_partial_acceptance_keeps_kv_consistent(synthetic_gguf):
    path = synthetic_gguf(n_layer=2, n_embd=64, vocab=320, weight_scale=0.5, seed=3)
    prompt = list(range(3, 40))
    _check_consistency(path, prompt, cycles=12, seed=2)


@pytest.mark.slow
def test_propose_never_redecodes_cached_tokens(synthetic_gguf):
    path = synthetic_gguf(n_layer=2, vocab=320, weight_scale=0.5)
    with DraftModelProposer(_engine(path), owns_engine=True) as draft:
        prompt = list(range(5, 5 + 70))
        draft.reset(prompt)
        s = draft.stats
        assert (s.rows, s.calls, s.logit_rows) == (70, 3, 1)   # chunks of 32: 32 + 32 + 6
        d = draft.propose([], 4)
        s2 = draft.stats
        assert s2.rows - s.rows == 3 and s2.calls - s.calls == 3  # d1 came with the prefill
        assert draft.propose([], 4) == d                          # nothing new: nothing decoded
        assert draft.stats.rows == s2.rows
        # plain decoding (speculation cold): tokens accumulate, one catch-up call later
        draft.accept(d[:1])
        for t in (9, 10, 11, 12, 13):
            draft.accept([t])
        s3 = draft.stats
        draft.propose([], 1)
        s4 = draft.stats
        assert s4.rows - s3.rows == 5 and s4.calls - s3.calls == 1   # d1 was cached already
        # a new request sharing a prefix (multi-turn chat) reuses the cached prefix
        draft.reset(prompt + [20, 21])
        s5 = draft.stats
        assert s5.rows - s4.rows == 2


@pytest.mark.slow
def test_stop_ids_and_empty_context(synthetic_gguf):
    path = synthetic_gguf(n_layer=2, vocab=320, weight_scale=0.5)
    with DraftModelProposer(_engine(path), owns_engine=True) as draft:
        draft.reset([])
        assert draft.propose([], 4) == []
        draft.reset([5, 6, 7])
        full = draft.propose([], 6)
    with DraftModelProposer(_engine(path), owns_engine=True, stop_ids={full[1]}) as draft:
        draft.reset([5, 6, 7])
        got = draft.propose([], 6)
        assert got == full[: full.index(full[1]) + 1]


@pytest.mark.slow
def test_propose_stops_at_the_drafts_context_size(synthetic_gguf):
    path = synthetic_gguf(n_layer=2, vocab=320)
    eng = StageEngine(EngineConfig(path, n_ctx=16, n_batch=16, n_seq_max=1, n_threads=1))
    with DraftModelProposer(eng, owns_engine=True) as draft:
        draft.reset(list(range(3, 15)))           # 12 of 16 positions
        assert len(draft.propose([], 10)) == 5     # d1 + 4 fed rows fill positions 12..15
        draft.accept([3, 4, 5, 6, 7])              # context 17 > 16: the draft gives up
        assert draft.propose([], 4) == []


# ---- vocabulary -------------------------------------------------------------------------------

def test_read_gguf_vocab_matches_gguf_reader(synthetic_gguf):
    from gguf import GGUFReader

    path = synthetic_gguf(vocab=300)
    expected = GGUFReader(path).get_field("tokenizer.ggml.tokens").contents()
    assert read_gguf_vocab(path) == expected


def test_check_vocab_same_and_different(synthetic_gguf, tmp_path: Path):
    a = synthetic_gguf("a.gguf", vocab=320, seed=1)
    b = synthetic_gguf("b.gguf", vocab=320, seed=2, n_layer=2)
    c = synthetic_gguf("c.gguf", vocab=330)
    check_vocab(a, b)                           # same tokenizer, other weights: fine
    check_vocab(read_gguf_vocab(a), b)          # target given as its token texts
    with pytest.raises(DraftVocabMismatch, match="330 tokens.*320"):
        check_vocab(a, c)
    texts = read_gguf_vocab(a)
    texts[300] = "▁different"
    with pytest.raises(DraftVocabMismatch, match="token 300"):
        check_vocab(texts, b)
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"nope" * 10)
    with pytest.raises(DraftVocabMismatch, match="not.gguf"):
        check_vocab(a, bad)


@pytest.mark.slow
def test_check_vocab_real_model(smol_path: Path, synthetic_gguf):
    from meshnode.engine.tokenizer import Tokenizer

    vocab = read_gguf_vocab(smol_path)
    tok = Tokenizer(smol_path)
    try:
        assert len(vocab) == tok.n_vocab == 49152
    finally:
        tok.close()
    check_vocab(smol_path, smol_path)
    with pytest.raises(DraftVocabMismatch) as info:
        check_vocab(smol_path, synthetic_gguf(vocab=320))
    print(f"\nmismatch message: {info.value}")


@pytest.mark.slow
def test_constructed_from_a_path_owns_its_engine(synthetic_gguf):
    path = synthetic_gguf(n_layer=2, vocab=320, weight_scale=0.5)
    with DraftModelProposer(path, n_ctx=64, n_batch=N_BATCH, n_threads=1) as a:
        a.reset([5, 6, 7])
        from_path = a.propose([], 4)
    with DraftModelProposer(_engine(path), owns_engine=True) as b:
        b.reset([5, 6, 7])
        assert b.propose([], 4) == from_path
    with StageEngine(EngineConfig(path, n_ctx=64, n_batch=16, n_seq_max=1, n_threads=1,
                                has_head=False)) as stage:
        with pytest.raises(ValueError, match="whole model"):
            DraftModelProposer(stage)


def _caught_up_in_one_go(synthetic_gguf) -> tuple[Path, list[int], list[int]]:
    """A small draft, a 70-token prompt, and the proposal after an eager reset of it and
    two accepted tokens: what any other way of catching up must propose too."""
    path = synthetic_gguf(n_layer=2, vocab=320, weight_scale=0.5)
    prompt = list(range(5, 5 + 70))
    with DraftModelProposer(_engine(path), owns_engine=True) as eager:
        eager.reset(prompt)
        eager.accept([9, 10])
        return path, prompt, eager.propose([], 4)


@pytest.mark.slow
def test_a_lazy_reset_prefills_at_the_first_proposal(synthetic_gguf):
    # While the auto policy cools down a request never drafts: reset(sync=False) must cost
    # the draft nothing, and the first proposal must equal an eager reset's.
    path, prompt, want = _caught_up_in_one_go(synthetic_gguf)
    with DraftModelProposer(_engine(path), owns_engine=True) as lazy:
        lazy.reset(prompt, sync=False)
        lazy.accept([9, 10])
        assert lazy.stats.rows == 0 and lazy.stats.calls == 0
        assert lazy.propose([], 4) == want
        assert lazy.stats.rows == 72 + 3        # context caught up in one go, then 3 drafts


@pytest.mark.slow
def test_a_catch_up_in_pieces_proposes_what_one_in_one_go_does(synthetic_gguf):
    # On a split the draft catches up on a prompt a piece at a time, while steps are away
    # (serve/speculation.py): each piece decodes at most its rows, and the proposal after
    # the last equals one after a single catch-up.
    path, prompt, want = _caught_up_in_one_go(synthetic_gguf)
    with DraftModelProposer(_engine(path), owns_engine=True) as pieces:
        pieces.reset(prompt, sync=False)
        for lag in (70, 54, 38, 22, 6):
            assert pieces.lag == lag
            pieces.sync(16)
        assert pieces.lag == 0 and pieces.stats.rows == 70 and pieces.stats.calls == 5
        pieces.accept([9, 10])
        assert pieces.propose([], 4) == want
        pieces.sync(16)                          # in sync: nothing to do
        assert pieces.stats.rows == 70 + 2 + 3


@pytest.mark.slow
def test_a_padding_engine_drafts_in_calls_of_one_shape(synthetic_gguf):
    """On a GPU engine (pad 2 here, on the CPU) every call of drafting (catch-ups of up to
    UNIFORM_CATCHUP_ROWS rows, one-row steps) has the shape of a padded one-row step, so
    llama.cpp keeps replaying one CUDA graph; the drafts are those of an unpadded draft."""
    from meshnode.spec.draft import UNIFORM_CATCHUP_ROWS

    path = synthetic_gguf(n_layer=2, vocab=320, weight_scale=0.5, seed=5)
    padded = StageEngine(EngineConfig(path, n_ctx=512, n_batch=N_BATCH, n_seq_max=1, n_threads=1, pad_rows=2))
    calls: list[tuple[int, int]] = []
    forward = padded.forward

    def spy(segs, **kw):
        calls.extend((s.n_rows, s.n_logits) for s in segs)
        return forward(segs, **kw)

    padded.forward = spy
    rng = random.Random(4)
    with DraftModelProposer(padded, owns_engine=True) as a, DraftModelProposer(_engine(path), owns_engine=True) as b:
        prompt = list(range(3, 60))
        a.reset(prompt)
        b.reset(prompt)
        calls.clear()   # the prompt is one long call, as on any engine
        for _ in range(12):
            k = rng.randint(1, 4)
            da, db = a.propose([], k), b.propose([], k)
            assert da == db
            m = rng.randint(0, k)
            tail = [*da[:m], rng.randrange(320)] + [rng.randrange(320) for _ in range(rng.randint(0, 5))]
            a.accept(tail)
            b.accept(tail)
        assert calls and all(rows <= 2 and logits == rows for rows, logits in calls), calls
        # a long catch-up is one call again
        long_tail = [rng.randrange(320) for _ in range(UNIFORM_CATCHUP_ROWS + 1)]
        a.accept(long_tail)
        b.accept(long_tail)
        calls.clear()
        assert a.propose([], 1) == b.propose([], 1)
        assert len(calls) == 1 and calls[0][0] > UNIFORM_CATCHUP_ROWS and calls[0][1] == 1, calls
