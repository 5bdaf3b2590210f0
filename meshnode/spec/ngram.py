"""Prompt-lookup (n-gram) drafting.

Theory of operation: the output of code edits, refactors and quoting answers keeps
repeating spans of the prompt or of itself. If the last ``n`` tokens of the context
occurred earlier, the tokens that followed that earlier occurrence are a free guess
for what comes next. The target model verifies the guess in one batch (see
``acceptance.py``), so a wrong guess costs verify time but never changes the output.

The index maps every n-gram (``min_n <= n <= max_n``) to the position right after its
most recent occurrence *whose continuation is known*. Appending token ``t`` at
position ``i`` registers, for each ``n``, the n-gram ending at ``i - 1`` as being
followed by position ``i``: O(max_n) dictionary writes per token, no rescans. The
current suffix is never its own hit because its continuation is not known yet, so a
lookup always finds an *earlier* occurrence. Longer n-grams are tried first (more
context, fewer false hits), then shorter ones down to ``min_n``.

A continuation that runs into the end of the context continues from the proposal
itself (``ext = tokens + proposal``), so a periodic tail such as ``a b a b`` proposes
``a b a b ...`` for any window. :meth:`NGramProposer.would_hit` is the cheap check the
auto policy uses while speculation is cold: did the index predict the token that was
actually generated? It costs one lookup and no verify pass.

Pure logic: no I/O, no clock, no engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["NGramProposer", "NGramDrafter"]


class NGramProposer:
    """Incremental n-gram index over prompt + generated tokens.

    ``max_n`` / ``min_n`` bound the n-gram lengths tried (longest first). Raises
    ``ValueError`` when ``not 1 <= min_n <= max_n``.
    """

    __slots__ = ("max_n", "min_n", "_tokens", "_index")

    def __init__(self, prompt: Iterable[int] = (), *, max_n: int = 4, min_n: int = 1) -> None:
        if not (isinstance(min_n, int) and isinstance(max_n, int)) or not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self._tokens: list[int] = []
        # _index[n - min_n][ngram] = position following the latest occurrence of ngram
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]
        self.observe(prompt)

    # ---- feeding --------------------------------------------------------------

    def reset(self, prompt: Iterable[int] = ()) -> None:
        """Forget everything and index ``prompt`` as the new context."""
        self._tokens = []
        for d in self._index:
            d.clear()
        self.observe(prompt)

    def observe(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` (accepted / generated tokens, in order) to the context."""
        toks = self._tokens
        index = self._index
        min_n = self.min_n
        for t in tokens:
            i = len(toks)
            # the n-grams ending at i-1 are now followed by position i
            for n in range(min_n, min(self.max_n, i) + 1):
                index[n - min_n][tuple(toks[i - n : i])] = i
            toks.append(int(t))

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> Sequence[int]:
        """The indexed context (read-only view; do not mutate)."""
        return self._tokens

    # ---- lookup ---------------------------------------------------------------

    def match(self, after: Sequence[int] = ()) -> tuple[int, int] | None:
        """``(n, start)`` of the longest suffix n-gram seen before, or None.

        ``start`` is the position following that earlier occurrence: the first
        proposed token is ``tokens[start]``. ``after``: tokens taken as appended to the
        context for this lookup only (the index is not changed).
        """
        # only the last max_n tokens of context + after can form the suffix
        tail = self._tokens[-self.max_n :]
        if after:
            tail = [*tail, *after][-self.max_n :]
        for n in range(len(tail), self.min_n - 1, -1):
            start = self._index[n - self.min_n].get(tuple(tail[len(tail) - n :]))
            if start is not None:
                return n, start
        return None

    def propose(self, k: int, *, min_match: int = 1, after: Sequence[int] = ()) -> list[int]:
        """Up to ``k`` draft tokens continuing the latest earlier occurrence of the suffix.

        Returns ``[]`` when no suffix n-gram of at least ``min_match`` tokens occurred
        before (or ``k <= 0``). The result always has exactly ``k`` tokens otherwise
        (periodic extension, see module doc). ``after``: continue the context as if
        these tokens followed it (drafts in flight), without indexing them.
        """
        if k <= 0:
            return []
        m = self.match(after)
        if m is None or m[0] < min_match:
            return []
        _, start = m
        toks = self._tokens
        n_toks = len(toks)
        size = n_toks + len(after)   # the context as extended by ``after``
        out: list[int] = []
        for j in range(k):
            p = start + j
            # p < size + j always holds (start < n_toks), so position p is already defined
            if p < n_toks:
                out.append(toks[p])
            elif p < size:
                out.append(after[p - n_toks])
            else:
                out.append(out[p - size])
        return out

    def would_hit(self, actual_next: int, *, min_match: int = 1) -> bool | None:
        """Would a one-token draft have predicted ``actual_next``? None: no draft at all
        (no suffix n-gram of at least ``min_match`` tokens occurred before).

        Call *before* :meth:`observe` of ``actual_next``. Cost: one index lookup.
        """
        m = self.match()
        if m is None or m[0] < min_match:
            return None
        return self._tokens[m[1]] == actual_next


class NGramDrafter:
    """:class:`~meshnode.spec.strategy.Proposer` adapter over :class:`NGramProposer`.

    The index already holds the whole context, so ``context_tail`` is ignored; the
    caller must feed every accepted token (and the bonus) through :meth:`accept`.
    """

    __slots__ = ("ngram",)

    def __init__(self, *, max_n: int = 4, min_n: int = 1) -> None:
        self.ngram = NGramProposer(max_n=max_n, min_n=min_n)

    def reset(self, prompt: Sequence[int]) -> None:
        self.ngram.reset(prompt)

    def propose(self, context_tail: Sequence[int], k: int) -> list[int]:
        return self.ngram.propose(k)

    def accept(self, tokens: Sequence[int]) -> None:
        self.ngram.observe(tokens)
