"""Prompt-lookup (n-gram) drafting.

Theory of operation: the output of code edits, refactors and quoting answers keeps
repeating spans of the prompt or of itself. If the last ``n`` tokens of the context
occurred earlier, the tokens that followed that earlier occurrence are a free guess
for what comes next. The target model verifies the guess in one batch (see
``acceptance.py``), so a wrong guess costs verify time but never changes the output.

The index maps every short n-gram (``min_n <= n <= BASE_N``) to the position right
after its most recent occurrence *whose continuation is known*, and keeps, for each
``BASE_N``-gram, the positions after all its occurrences. Appending token ``t`` at
position ``i`` registers, for each ``n``, the n-gram ending at ``i - 1`` as being
followed by position ``i``: O(BASE_N) dictionary writes per token, no rescans. The
current suffix is never its own hit because its continuation is not known yet, so a
lookup always finds an *earlier* occurrence.

A lookup wants the earlier occurrence whose preceding context agrees longest with the
current suffix, up to ``max_n`` tokens: code repeats short n-grams everywhere
(``self.data``, indentation), and the latest occurrence of a 4-gram is often not the
passage being copied. So a ``BASE_N``-gram hit is extended backwards token by token
over each of its (latest ``MAX_CANDIDATES``) occurrences, and the longest agreement
wins, the latest on ties: the same answer as trying every n from ``max_n`` down and
taking the latest occurrence of the longest that occurred. Shorter suffixes come from
the per-n dictionaries, longest first. On the code-editing prompts of
``meshnode bench spec``, replayed offline, ``max_n`` 12 instead of 4 kept acceptance
at 0.76 instead of 0.72 with 7% fewer pipeline steps (docs/speculative.md).

A continuation that runs into the end of the context continues from the proposal
itself (``ext = tokens + proposal``), so a periodic tail such as ``a b a b`` proposes
``a b a b ...`` for any window.

The *copy cursor* keeps the place in the copied text across an edit. An answer that
copies a file with a renamed identifier leaves the file at the new name, and the
suffix match needs ``min_match`` tokens past it before it finds the file again (or finds
the wrong place: ``(x)`` occurs everywhere). The cursor is the position the generated
text is copying from: placed by a match of ``CURSOR_ANCHOR_N`` tokens, moved one on for
every generated token that the text has there, and kept while the output is off the
text, so that the output taking it up again (the token at the cursor: the end of an
insertion; two tokens a little further on: the end of a replacement) puts it back in
step. Where the suffix match is shorter than ``min_match`` and the cursor is in step, a
proposal continues from the cursor. Only generated tokens move it (a prompt is indexed,
not followed). :meth:`NGramProposer.would_hit` is the cheap check the
auto policy uses while speculation is cold: did the index predict the token that was
actually generated? It costs one lookup and no verify pass.

Pure logic: no I/O, no clock, no engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["MIN_NGRAM_MATCH", "NGramProposer", "NGramDrafter", "min_match_for"]

BASE_N = 4            # n-grams up to this length are indexed; longer matches extend them
MAX_CANDIDATES = 64   # occurrences of a BASE_N-gram compared per lookup (the latest ones)
DEFAULT_MAX_N = 12
# n-gram drafts only continue a suffix of at least this many tokens seen before: a 1- or
# 2-token match in prose is mostly a coincidence, and its verify rows are paid for
# nothing (measured with `meshnode bench spec`, docs/speculative.md "Proposers").
MIN_NGRAM_MATCH = 3
# ... unless verify rows cost next to nothing: where a 1-draft window costs at most this
# many plain steps (a GPU split, whose steps are mostly hops), 2-token matches pay too.
# `meshnode bench replay --min-match 2,3 --max-window 3` (SmolLM2, 96 tokens): with the
# H200 split's step costs (a window 1.06-1.19 plain steps) 2 predicts 1.46x and 1.45x
# on the tune and held-out code edits against 1.42x and 1.41x for 3 (chat 1.15x
# against 1.13x); with this 2-core VM's own (1.52 plain steps) 3 predicts 1.17x against 1.15x.
CHEAP_WINDOW_STEPS = 1.25
# The copy cursor (see the module doc). A resync may skip up to RESYNC_SKIP tokens of the
# copied text beyond the output's own tokens since it left it (a replaced identifier of
# more tokens), and needs the output's last two tokens to agree there (one, right at the
# cursor: the end of an insertion); after CURSOR_MAX_GAP output tokens off the text the
# cursor is dropped; a match of CURSOR_ANCHOR_N tokens (re)places it. Settled on the tune
# half of `meshnode bench replay` (docs/speculative.md, "Proposers"): two tokens against
# one, skips of 8 against 2 and 4, gaps of 16 against 8 and 32, anchors of 4 against 3 and 6.
RESYNC_SKIP = 8
CURSOR_MAX_GAP = 16
CURSOR_ANCHOR_N = 4


def min_match_for(window_steps: float | None) -> int:
    """The shortest suffix match an n-gram draft continues where a 1-draft window costs
    ``window_steps`` plain steps (None: not measured yet). The serving loop asks it at
    every step, from its learned step costs; the offline replay benchmark does too."""
    if window_steps is not None and window_steps <= CHEAP_WINDOW_STEPS:
        return MIN_NGRAM_MATCH - 1
    return MIN_NGRAM_MATCH


class NGramProposer:
    """Incremental n-gram index over prompt + generated tokens.

    ``max_n`` / ``min_n`` bound the suffix lengths matched (longest first). Raises
    ``ValueError`` when ``not 1 <= min_n <= max_n``.
    """

    __slots__ = ("max_n", "min_n", "_base", "_tokens", "_index", "_starts", "_follows", "_cur", "_gap")

    def __init__(self, prompt: Iterable[int] = (), *, max_n: int = DEFAULT_MAX_N, min_n: int = 1,
                 cursor: bool = True) -> None:
        if not (isinstance(min_n, int) and isinstance(max_n, int)) or not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self._base = max(min_n, min(max_n, BASE_N))
        self._tokens: list[int] = []
        # _index[n - min_n][ngram] = position following the latest occurrence of ngram
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(self._base - min_n + 1)]
        # _starts[base-gram] = positions following each of its occurrences, ascending
        # (only kept when longer matches are wanted)
        self._starts: dict[tuple[int, ...], list[int]] | None = {} if max_n > self._base else None
        self._follows = cursor         # keep a copy cursor (see the module doc)?
        self._cur, self._gap = -1, 0   # ... where it is; -1: none
        self._index_only(prompt)

    # ---- feeding --------------------------------------------------------------

    def reset(self, prompt: Iterable[int] = ()) -> None:
        """Forget everything and index ``prompt`` as the new context."""
        self._tokens = []
        for d in self._index:
            d.clear()
        if self._starts is not None:
            self._starts.clear()
        self._cur, self._gap = -1, 0
        self._index_only(prompt)

    def observe(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` (accepted / generated tokens, in order) to the context, and
        move the copy cursor along them."""
        if not self._follows:
            self._index_only(tokens)
            return
        for t in tokens:
            self._index_only((t,))
            self._follow(t)

    def _follow(self, t: int) -> None:
        """Move the copy cursor past ``t``, the token just appended: along the text it
        copies, to where that text takes up ``t`` again, or (re)placed by a long match."""
        toks = self._tokens
        cur, gap = self._cur, self._gap
        if cur >= 0:
            cur, gap = _advance(toks, cur, gap, len(toks) - 1, t, toks[-2] if len(toks) > 1 else None)
        if cur < 0 or gap:
            m = self.match()
            if m is not None and m[0] >= CURSOR_ANCHOR_N:
                cur, gap = m[1], 0
        self._cur, self._gap = cur, gap

    def _index_only(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the context and the index; the cursor stays."""
        toks = self._tokens
        index = self._index
        starts = self._starts
        min_n, base = self.min_n, self._base
        for t in tokens:
            i = len(toks)
            # the n-grams ending at i-1 are now followed by position i
            for n in range(min_n, min(base, i) + 1):
                key = tuple(toks[i - n : i])
                index[n - min_n][key] = i
            if starts is not None and i >= base:
                starts.setdefault(key, []).append(i)   # the loop ended on the base-gram
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
        top = min(len(tail), self._base)
        if self._starts is not None and len(tail) >= self._base:
            found = self._longest(tail)
            if found is not None:
                return found
            top -= 1   # the base-gram never occurred: its dictionary would say the same
        for n in range(top, self.min_n - 1, -1):
            start = self._index[n - self.min_n].get(tuple(tail[len(tail) - n :]))
            if start is not None:
                return n, start
        return None

    def _longest(self, tail: list[int]) -> tuple[int, int] | None:
        """Among the occurrences of ``tail``'s last BASE_N tokens, the one whose earlier
        tokens agree longest with ``tail`` (the latest on ties), as ``(n, start)``."""
        assert self._starts is not None
        base = self._base
        starts = self._starts.get(tuple(tail[-base:]))
        if not starts:
            return None
        toks = self._tokens
        size = len(tail)
        best_n, best_start = 0, 0
        for start in reversed(starts[-MAX_CANDIDATES:]):   # latest first
            n = base
            limit = min(size, start)   # the occurrence cannot begin before position 0
            while n < limit and toks[start - n - 1] == tail[size - n - 1]:
                n += 1
            if n > best_n:
                best_n, best_start = n, start
                if n == size:
                    break   # the whole tail agrees: nothing can beat it
        return best_n, best_start

    def propose(self, k: int, *, min_match: int = 1, after: Sequence[int] = ()) -> list[int]:
        """Up to ``k`` draft tokens continuing the latest earlier occurrence of the suffix.

        Returns ``[]`` when no suffix n-gram of at least ``min_match`` tokens occurred
        before (or ``k <= 0``). The result always has exactly ``k`` tokens otherwise
        (periodic extension, see module doc). ``after``: continue the context as if
        these tokens followed it (drafts in flight), without indexing them.
        """
        if k <= 0:
            return []
        return self.propose_matched(self.match(after), k, min_match=min_match, after=after)

    def propose_matched(self, m: tuple[int, int] | None, k: int, *, min_match: int = 1,
                        after: Sequence[int] = ()) -> list[int]:
        """:meth:`propose` with ``m`` the caller's ``match(after)`` (looked up once)."""
        if k <= 0:
            return []
        if m is not None and m[0] >= min_match:
            start = m[1]
        else:
            cursor = self._cursor(after)
            if cursor is None:
                return []
            start = cursor
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
        d = self.propose(1, min_match=min_match)
        return None if not d else d[0] == actual_next

    def _cursor(self, after: Sequence[int] = ()) -> int | None:
        """Where the copy cursor says the text goes on (after ``after``, drafts in
        flight), or None: no cursor, or the output has left the copied text and not
        taken it up again."""
        toks = self._tokens
        cur, gap = self._cur, self._gap
        prev = toks[-1] if toks else None
        for t in after:
            if cur < 0:
                return None
            cur, gap = _advance(toks, cur, gap, len(toks), int(t), prev)
            prev = t
        return cur if cur >= 0 and not gap and cur < len(toks) else None


def _advance(toks: Sequence[int], cur: int, gap: int, limit: int, t: int, prev: int | None) -> tuple[int, int]:
    """The copy cursor ``(cur, gap)`` after the output token ``t`` (``prev`` before it):
    past ``t`` where the copied text (before ``limit``) has it at the cursor, or ``prev
    t`` within reach after it; else one more output token off the text (dropped, -1,
    after too many)."""
    if cur < limit and toks[cur] == t:
        return cur + 1, 0
    for q in range(cur + 1, min(cur + gap + RESYNC_SKIP + 1, limit)):
        if toks[q] == t and toks[q - 1] == prev:
            return q + 1, 0
    gap += 1
    return (cur, gap) if gap <= CURSOR_MAX_GAP else (-1, 0)


class NGramDrafter:
    """:class:`~meshnode.spec.strategy.Proposer` adapter over :class:`NGramProposer`.

    The index already holds the whole context, so ``context_tail`` is ignored; the
    caller must feed every accepted token (and the bonus) through :meth:`accept`.
    """

    __slots__ = ("ngram",)

    def __init__(self, *, max_n: int = DEFAULT_MAX_N, min_n: int = 1) -> None:
        self.ngram = NGramProposer(max_n=max_n, min_n=min_n)

    def reset(self, prompt: Sequence[int], *, sync: bool = True) -> None:
        self.ngram.reset(prompt)   # indexing is cheap: always now

    def propose(self, context_tail: Sequence[int], k: int) -> list[int]:
        return self.ngram.propose(k)

    def accept(self, tokens: Sequence[int]) -> None:
        self.ngram.observe(tokens)
