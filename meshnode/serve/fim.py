"""Fill-in-the-middle prompts, laid out token for token as llama.cpp's server does.

llama.cpp's ``/infill`` (tools/server, ``format_infill``) builds the repo-level pattern
of Qwen2.5-Coder (arXiv 2409.12186)::

    [FIM_REP]myproject\n [FIM_SEP]file0\n extra0 ... [FIM_SEP]filename\n
    [BOS] [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]

``[FIM_REP]`` / ``[FIM_SEP]`` only where the vocabulary has them (without ``[FIM_SEP]``
extra chunks are separated by a ``--- snippet ---`` line); ``[BOS]`` when the vocabulary
adds one. The prefix keeps its last ``3/4 * n_batch`` tokens, the suffix its first
``n_batch/4 - 2 - len(prompt)``, and the extra context its last
``n_ctx - n_batch - 2 * n_predict``, with llama.cpp's default ``n_batch`` of 2048: the
same request gives the same token ids here as on ``llama-server``. Prefix, suffix and
extra text are tokenized without parsing special tokens (text that spells
``<fim_prefix>`` stays text); ``prompt`` parses them, as llama.cpp does.

A model can fill in the middle when llama.cpp finds its FIM prefix, suffix and middle
tokens (:class:`meshnode.engine.tokenizer.FimTokens`): the GGUF's
``tokenizer.ggml.fim_pre_token_id`` / ``fim_suf_token_id`` / ``fim_mid_token_id`` or the
older ``prefix_token_id`` / ``suffix_token_id`` / ``middle_token_id`` keys.
"""

from __future__ import annotations

from typing import Any

from meshnode.serve.client import InfillPrompt

# llama.cpp server's default n_batch: the prefix and suffix budgets are cut from it.
FIM_BATCH = 2048
REPO_NAME = "myproject\n"          # llama.cpp's placeholder project name
CURRENT_FILE = "filename\n"        # ... and current file name
DEFAULT_FILE = "tmp"               # an extra chunk without a filename
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"   # between extra chunks without [FIM_SEP]
NO_FIM = ("cannot fill in the middle: llama.cpp finds no FIM prefix/suffix/middle tokens in "
          "its GGUF (tokenizer.ggml.fim_pre_token_id, fim_suf_token_id, fim_mid_token_id)")


def fim_reason(tokenizer: Any) -> str | None:
    """Why ``tokenizer``'s model cannot fill in the middle (None: it can)."""
    fim = getattr(tokenizer, "fim", None)
    return None if fim is not None and fim.usable else NO_FIM


def infill_tokens(tokenizer: Any, infill: InfillPrompt, *, n_ctx: int, n_predict: int = -1,
                  n_batch: int = FIM_BATCH) -> list[int]:
    """The prompt tokens of ``infill`` (see the module docstring). ``n_predict`` -1: no
    limit (llama.cpp's default). The caller checks :func:`fim_reason` first."""
    fim = tokenizer.fim

    def text(s: str) -> list[int]:
        return list(tokenizer.encode(s, add_bos=False, special=False)) if s else []

    prefix, suffix = text(infill.prefix), text(infill.suffix)
    prompt = list(tokenizer.encode(infill.prompt, add_bos=False, special=True)) if infill.prompt else []
    extra: list[int] = []
    if fim.rep >= 0:
        extra += [fim.rep, *text(REPO_NAME)]
    for filename, chunk in infill.extra:
        extra += [fim.sep, *text((filename or DEFAULT_FILE) + "\n")] if fim.sep >= 0 else text(CHUNK_SEPARATOR)
        extra += text(chunk)
    if fim.sep >= 0:
        extra += [fim.sep, *text(CURRENT_FILE)]
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    head = [fim.pre, *prefix[len(prefix) - n_prefix:], *prompt]
    if tokenizer.add_bos:
        head.insert(0, tokenizer.bos_id)
    return [*extra[len(extra) - n_extra:], *head, fim.suf, *suffix[:n_suffix], fim.mid]
