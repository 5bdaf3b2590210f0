"""Derived drafts (requantized, truncated) load, keep the vocabulary, and agree with the
target to a measured degree (printed, not asserted)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from meshnode.engine import EngineConfig, Segment, StageEngine  # noqa: E402
from meshnode.spec.derive import requantize, truncate_layers  # noqa: E402
from meshnode.engine.errors import ModelLoadError  # noqa: E402
from meshnode.models.errors import SliceRangeError  # noqa: E402
from meshnode.models.gguf_info import read_model_info  # noqa: E402
from meshnode.spec.acceptance import verify_greedy  # noqa: E402
from meshnode.spec.draft import DraftModelProposer, check_vocab  # noqa: E402

N_BATCH = 32
N_TOKENS = 64
CODE_PROMPT = (
    "<|im_start|>user\nWrite a Python function that parses a CSV file and returns the sum "
    "of the 'amount' column.<|im_end|>\n<|im_start|>assistant\n```python\nimport csv\n\n"
)


def _engine(path: Path, n_seq_max: int = 1) -> StageEngine:
    return StageEngine(EngineConfig(path, n_ctx=512, n_batch=N_BATCH, n_seq_max=n_seq_max, n_threads=1))


def _greedy(engine: StageEngine, prompt: list[int], n: int, session: int = 0) -> tuple[list[int], float]:
    """Plain greedy tokens and the mean decode time per token (s)."""
    logits = engine.run_session(session, 0, np.asarray(prompt, dtype=np.int32), n_logits=1)
    out = [int(np.argmax(logits[-1]))]
    t0 = time.perf_counter()
    while len(out) < n:
        pos = len(prompt) + len(out) - 1
        row = engine.forward([Segment(session, pos, tokens=np.asarray(out[-1:], dtype=np.int32),
                                      n_logits=1)])[0]
        out.append(int(np.argmax(row[-1])))
    per_token = (time.perf_counter() - t0) / (n - 1)
    engine.drop(session)
    return out, per_token


def _teacher_forced_agreement(engine: StageEngine, prompt: list[int], target: list[int]) -> float:
    """Fraction of positions where the draft's argmax, fed the target's own context, is the
    target's next token (= acceptance of a 1-token window)."""
    ctx = np.asarray(prompt + target[:-1], dtype=np.int32)
    # logits of the rows at positions len(prompt)-1 .. len(prompt)+len(target)-2
    engine.run_session(0, 0, ctx[:len(prompt) - 1], n_logits=0)
    rows = []
    tail = ctx[len(prompt) - 1:]
    for start in range(0, len(tail), N_BATCH):
        chunk = tail[start:start + N_BATCH]
        rows.append(engine.forward([Segment(0, len(prompt) - 1 + start, tokens=chunk,
                                            n_logits=len(chunk))])[0])
    engine.drop(0)
    argmax = np.argmax(np.concatenate(rows), axis=1)
    return float(np.mean(argmax == np.asarray(target)))


def _speculative_acceptance(target_path: Path, draft_path: Path, prompt: list[int],
                            reference: list[int], k: int = 4) -> tuple[float, float]:
    """Greedy speculative decoding of len(reference) tokens with window k: (accepted /
    proposed, tokens per verify step). Asserts the output equals plain greedy."""
    target = _engine(target_path)
    with target, DraftModelProposer.open(draft_path, n_ctx=512, n_batch=N_BATCH, n_threads=1) as draft:
        logits = target.run_session(0, 0, np.asarray(prompt, dtype=np.int32), n_logits=1)
        out = [int(np.argmax(logits[-1]))]
        draft.reset(prompt)
        draft.accept(out)
        proposed = accepted = steps = 0
        while len(out) < len(reference):
            drafts = draft.propose(out[-1:], k)
            pos = len(prompt) + len(out) - 1
            rows = np.asarray([out[-1], *drafts], dtype=np.int32)
            verify = target.forward([Segment(0, pos, tokens=rows, n_logits=len(rows))], rewind=True)[0]
            argmax = [int(i) for i in np.argmax(verify, axis=1)]
            m = verify_greedy(argmax, drafts)
            emitted = [*drafts[:m], argmax[m]]
            target.rollback(0, pos + 1 + m)
            proposed += len(drafts)
            accepted += m
            steps += 1
            out.extend(emitted)
            draft.accept(emitted)
    assert out[:len(reference)] == reference  # speculation never changes greedy output
    return accepted / max(1, proposed), (len(out) - 1) / max(1, steps)


# ---- synthetic models (seconds, but llama.cpp loads them: slow) ------------------------------

@pytest.mark.slow
def test_requantize_synthetic(synthetic_gguf, tmp_path: Path):
    src = synthetic_gguf(n_layer=2, n_embd=64, vocab=320)
    dest = requantize(src, tmp_path / "q.gguf", "Q4_0")
    info = read_model_info(dest)
    assert info.n_vocab == 320 and info.n_layers == 2
    assert info.file_type == 2  # LLAMA_FTYPE_MOSTLY_Q4_0
    check_vocab(src, dest)
    with _engine(dest) as eng:
        out = eng.run_session(0, 0, np.arange(3, 10, dtype=np.int32), n_logits=1)
        assert out.shape == (1, 320) and np.isfinite(out).all()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []


def test_requantize_errors_leave_nothing(tmp_path: Path, synthetic_gguf):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        requantize(bad, tmp_path / "out.gguf", "Q4_0")
    with pytest.raises(ValueError, match="unknown quantization"):
        requantize(synthetic_gguf(), tmp_path / "out.gguf", "Q9_X")
    assert not (tmp_path / "out.gguf").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []


@pytest.mark.slow
def test_truncate_layers_synthetic(synthetic_gguf, tmp_path: Path):
    src = synthetic_gguf(n_layer=4, vocab=320)
    dest = truncate_layers(src, tmp_path / "t.gguf", 2)
    info = read_model_info(dest)
    assert info.n_layers == 2 and info.n_vocab == 320
    assert info.tensor_names.issuperset({"output.weight", "output_norm.weight", "token_embd.weight"})
    check_vocab(src, dest)
    with _engine(dest) as eng:
        assert eng.n_layer == 2
        assert eng.run_session(0, 0, np.arange(3, 10, dtype=np.int32), n_logits=1).shape == (1, 320)
    with pytest.raises(SliceRangeError):
        truncate_layers(src, tmp_path / "x.gguf", 5)
    with pytest.raises(SliceRangeError):
        truncate_layers(src, tmp_path / "x.gguf", 0)


# ---- slow: SmolLM2, with measured agreement ---------------------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2) -> tuple[Path, list[int], list[int], float]:
    """(path, code prompt tokens, target's 64 greedy tokens, target s/token)."""
    from meshnode.engine.tokenizer import Tokenizer

    path = Path(smollm2.path)
    tok = Tokenizer(path)
    try:
        prompt = tok.encode(CODE_PROMPT, add_bos=False)
    finally:
        tok.close()
    with _engine(path) as eng:
        reference, per_token = _greedy(eng, prompt, N_TOKENS)
    return path, prompt, reference, per_token


def _report(kind: str, smol, draft: Path) -> None:
    path, prompt, reference, target_s = smol
    with _engine(draft) as eng:
        agreement = _teacher_forced_agreement(eng, prompt, reference)
        _, draft_s = _greedy(eng, prompt, 16)
    acc, per_step = _speculative_acceptance(path, draft, prompt, reference, k=4)
    print(f"\n[{kind}] {draft.stat().st_size / 1e6:.1f} MB; top-1 agreement with target over "
          f"{N_TOKENS} tokens (teacher-forced): {agreement:.1%}; speculative k=4: acceptance "
          f"{acc:.1%}, {per_step:.2f} tokens/verify; decode {draft_s * 1e3:.1f} ms/token vs "
          f"target {target_s * 1e3:.1f} ms/token (1 thread)")


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["Q4_0", "Q3_K_S", "Q2_K"])
def test_requantized_smollm2(smol, tmp_path: Path, ftype: str):
    path = smol[0]
    dest = requantize(path, tmp_path / f"draft-{ftype}.gguf", ftype)
    check_vocab(path, dest)
    assert read_model_info(dest).n_layers == 30
    _report(f"requantize {ftype}", smol, dest)


@pytest.mark.slow
@pytest.mark.parametrize("n_keep", [10, 20, 26])
def test_truncated_smollm2(smol, tmp_path: Path, n_keep: int):
    path = smol[0]
    dest = truncate_layers(path, tmp_path / f"draft-{n_keep}L.gguf", n_keep)
    check_vocab(path, dest)
    assert read_model_info(dest).n_layers == n_keep
    _report(f"truncate to {n_keep}/30 layers", smol, dest)


@pytest.mark.slow
def test_importing_derive_does_not_load_llama_cpp():
    import subprocess
    import sys

    code = ("import sys, meshnode.spec.derive; "
            "print('llama_cpp' in sys.modules, 'meshnode.engine' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
