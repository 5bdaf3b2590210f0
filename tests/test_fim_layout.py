"""Fill-in-the-middle prompt layout on a random-weight GGUF that declares FIM tokens:
llama.cpp (vocab loaded by llama.cpp itself) finds the declared ids, and the prompt
is llama.cpp server's format_infill layout, token id for token id."""

from __future__ import annotations

import pytest
from gguf import GGUFValueType

from meshnode.engine.tokenizer import Tokenizer
from meshnode.models.synthetic import synthetic_vocab, write_synthetic_gguf
from meshnode.serve.client import InfillPrompt
from meshnode.serve.fim import CHUNK_SEPARATOR, fim_reason, infill_tokens

pytestmark = pytest.mark.slow   # llama.cpp loads the vocabulary

U32 = GGUFValueType.UINT32


def _model(tmp_path, keys: dict[str, int]):
    meta = tuple((k, v, U32, None) for k, v in keys.items())
    return Tokenizer(write_synthetic_gguf(tmp_path / "fim.gguf", extra_metadata=meta))


def _ids(n: int = 320) -> list[int]:
    tokens, _, _ = synthetic_vocab(n)
    return [tokens.index(t) for t in ("▁e", "▁t", "▁a", "▁o", "▁i")]


def test_declared_fim_tokens_and_llama_cpp_layout(tmp_path):
    pre, suf, mid, rep, sep = _ids()
    tok = _model(tmp_path, {"tokenizer.ggml.fim_pre_token_id": pre, "tokenizer.ggml.fim_suf_token_id": suf,
                            "tokenizer.ggml.fim_mid_token_id": mid, "tokenizer.ggml.fim_rep_token_id": rep,
                            "tokenizer.ggml.fim_sep_token_id": sep})
    assert (tok.fim.pre, tok.fim.suf, tok.fim.mid, tok.fim.rep, tok.fim.sep) == (pre, suf, mid, rep, sep)
    assert fim_reason(tok) is None

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_bos=False, special=False)

    infill = InfillPrompt(prefix="def add(a, b):\n", suffix="\nprint(add)\n", prompt="    ret",
                          extra=(("util.py", "x = 1\n"), ("", "y = 2\n")))
    got = infill_tokens(tok, infill, n_ctx=4096, n_predict=16)
    extra = ([rep, *enc("myproject\n")] + [sep, *enc("util.py\n"), *enc("x = 1\n")]
             + [sep, *enc("tmp\n"), *enc("y = 2\n")] + [sep, *enc("filename\n")])
    want = (extra + [tok.bos_id, pre, *enc("def add(a, b):\n"), *tok.encode("    ret", add_bos=False, special=True),
                     suf, *enc("\nprint(add)\n"), mid])
    assert got == want
    # budgets: the prefix keeps its last 3/4 n_batch tokens, the suffix its first
    # n_batch/4 - 2 - len(prompt), the extra context its last n_ctx - n_batch - 2 n_predict
    long = InfillPrompt(prefix="a b c d e f g h " * 4, suffix="z y x w v u " * 4, extra=(("f", "q r s " * 20),))
    small = infill_tokens(tok, long, n_ctx=64, n_predict=4, n_batch=16)
    p, s = enc(long.prefix), enc(long.suffix)
    full_extra = [rep, *enc("myproject\n"), sep, *enc("f\n"), *enc(long.extra[0][1]), sep, *enc("filename\n")]
    n_extra = min(64 - 16 - 8, len(full_extra))
    assert small == [*full_extra[len(full_extra) - n_extra:], tok.bos_id, pre, *p[-12:], suf, *s[:2], mid]


def test_older_keys_and_no_separator(tmp_path):
    pre, suf, mid, _, _ = _ids()
    tok = _model(tmp_path, {"tokenizer.ggml.prefix_token_id": pre, "tokenizer.ggml.suffix_token_id": suf,
                            "tokenizer.ggml.middle_token_id": mid})
    assert tok.fim.usable and tok.fim.sep < 0 and tok.fim.rep < 0
    got = infill_tokens(tok, InfillPrompt(prefix="a", suffix="b", extra=(("f", "c"),)), n_ctx=4096)

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_bos=False, special=False)

    assert got == [*enc(CHUNK_SEPARATOR), *enc("c"), tok.bos_id, pre, *enc("a"), suf, *enc("b"), mid]


def test_model_without_fim_tokens_says_why(tmp_path):
    tok = _model(tmp_path, {})
    assert not tok.fim.usable
    assert "FIM" in (fim_reason(tok) or "")
