"""Grammar-constrained sampling at stage 0: one request's grammar state and its masks.

Theory of operation
-------------------
A :class:`~meshnode.serve.tools.Structure` compiles (llguidance, over the model's
vocabulary: :meth:`meshnode.engine.tokenizer.Tokenizer.grammar_tokenizer`) into an
``LLMatcher`` per request: :func:`compile_constraint`, which turns a grammar llguidance
refuses (an unsupported or malformed JSON schema) into a 400 naming the field.

Sampling happens where the logits are, the final stage; the grammar lives here, beside
the tokenizer and the request. So for every step that wants logits, stage 0 computes one
allowed-token bitmask per logit row (:meth:`Constraint.masks`): row 0 for the token after
``last``; for a verify window ``[last, d1..dk]`` the matcher is advanced through the
drafts and row i is the mask after ``d1..di``. A draft the grammar forbids is outside
its row's mask, so the final stage rejects it as it rejects any mismatch, and the rows
after it are never used (they repeat the last valid row, so they still sample). The
matcher is rolled back to the committed tokens afterwards, and :meth:`Constraint.commit`
advances it by what the final stage actually returned. The masks travel with the step
(``Step.mask``; on a split the ``GrammarMask`` frame, docs/protocol.md).

Masks are ``uint32`` words, bit ``t % 32`` of word ``t // 32`` for token ``t``
(llguidance's layout). Cost: 37 us median, 0.2 ms worst, per row for SmolLM2's 49152
tokens through a tool-call grammar (docs/api.md, "Tools and structured output").
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from meshnode.serve.errors import InvalidRequestError
from meshnode.serve.tools import Structure

log = logging.getLogger(__name__)

# llguidance's resource limits bound what a hostile schema can make stage 0 do per token.
MAX_GRAMMAR_CHARS = 256 * 1024


class Constraint:
    """One request's grammar: masks for a step's rows, and the committed tokens."""

    def __init__(self, matcher: Any, n_vocab: int, eos: frozenset[int] = frozenset()) -> None:
        self._m = matcher
        self._eos = eos
        self.n_vocab = n_vocab
        self.words = (n_vocab + 31) // 32

    def _mask(self) -> np.ndarray:
        row = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint32)
        if row.shape[0] < self.words:   # the grammar's vocabulary may be shorter than the head
            row = np.concatenate([row, np.zeros(self.words - row.shape[0], np.uint32)])
        return row[:self.words]

    def masks(self, drafts: tuple[int, ...] | list[int] = ()) -> np.ndarray:
        """``(len(drafts) + 1, words)`` uint32: the allowed tokens of each logit row of
        ``[last, *drafts]``. The matcher ends where it began."""
        out = np.empty((len(drafts) + 1, self.words), dtype=np.uint32)
        out[0] = self._mask()
        n_ok = self._m.validate_tokens(list(drafts)) if drafts else 0
        # never consume an end-of-generation draft: it stops the matcher, and a rollback
        # across the stop does not restore it (the request ends there anyway)
        n_ok = next((i for i in range(n_ok) if int(drafts[i]) in self._eos), n_ok)
        for i in range(n_ok):
            if not self._m.consume_token(int(drafts[i])):   # validated: cannot fail
                raise RuntimeError(f"grammar refused a validated draft: {self._m.get_error()}")
            out[i + 1] = self._mask()
        if n_ok and not self._m.rollback(n_ok):
            raise RuntimeError(f"the grammar could not roll back {n_ok} draft(s): {self._m.get_error()}")
        # rows after a forbidden draft are never reached: any mask that samples will do
        out[n_ok + 1:] = out[n_ok]
        return out

    def commit(self, tokens: list[int] | tuple[int, ...]) -> None:
        """The step's result (accepted drafts, then the bonus): each was sampled under
        its row's mask, so the grammar takes it."""
        for t in tokens:
            if self._m.is_stopped():
                return   # after the end: only end-of-generation, which the request stops on
            if not self._m.consume_token(int(t)):
                raise RuntimeError(f"the grammar refused sampled token {t}: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        return bool(self._m.is_stopped())


def compile_constraint(structure: Structure, tokenizer: Any, param: str) -> Constraint:
    """An LLMatcher for ``structure``; InvalidRequestError (``param``) when the grammar
    (the request's schema) cannot be compiled."""
    import llguidance

    grammar_text = structure.grammar()
    if len(grammar_text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(param, f"The schema is too large ({len(grammar_text)} characters of grammar, "
                                  f"at most {MAX_GRAMMAR_CHARS}).")
    lltok = tokenizer.grammar_tokenizer()
    grammar = llguidance.LLMatcher.grammar_from_lark(grammar_text)
    err = llguidance.LLMatcher.validate_grammar(grammar, lltok)
    if err:
        raise InvalidRequestError(param, f"Unsupported or invalid JSON schema: {_one_line(err)}")
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequestError(param, f"Unsupported or invalid JSON schema: {_one_line(matcher.get_error())}")
    return Constraint(matcher, int(tokenizer.n_vocab), frozenset(lltok.eos_tokens))


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]

