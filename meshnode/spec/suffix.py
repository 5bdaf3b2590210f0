"""Drafting from the same client's recent requests: a suffix automaton over their texts.

Theory of operation: an editor sends the same file again and again, a little changed,
with the same kind of request; the answer to the new request then repeats much of the
*previous answer*, which the current prompt does not contain (a renamed identifier
appears in the old answer, not in the new prompt). :class:`RecentTexts` keeps, per
client, the token texts (prompt + generated) of its last requests, and a
:class:`SuffixAutomaton` over them, newest first. :class:`SuffixProposer` drafts from
whichever source matches the current context's tail longer: the request's own
:class:`~meshnode.spec.ngram.NGramProposer` (prompt + generated, latest occurrence) or
the automaton (the longest suffix of the context that occurs anywhere in the recent
texts, found in O(1) amortized per generated token by walking the automaton alongside
the decode; the continuation comes from its first occurrence, i.e. the newest text).

The automaton is the classic online construction (Blumer et al.): at most ``2n`` states
for ``n`` tokens, each with a transition dict, the suffix link, the longest length and
the end position of its first occurrence. Texts are separated by unique negative
tokens, so no match crosses from one request into another and a continuation stops at
the end of its text. Building is O(n) dictionary work; :meth:`RecentTexts.add` does it
once per finished request (the serving loop runs it off the event loop) and swaps the
client's automaton in whole, so a request in flight keeps reading the one it started
with.

"Client" is the caller's peer address plus (a hash of) the API key the request carried
(``Authorization: Bearer``), if any: one editor session is one address and key, and two
callers never draft from each other's texts (users of one shared key at different
addresses neither). Bounded: at most ``max_clients``
clients, ``max_tokens`` tokens in all (the oldest texts of any client are evicted
first), texts older than ``max_age_s`` are dropped; a client with none left is
forgotten. Memory is linear in the kept tokens (about 2 states each).

Pure logic: no I/O; ``now`` is passed in.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from meshnode.spec.ngram import DEFAULT_MAX_N, NGramProposer

__all__ = ["HISTORY_MIN_MATCH", "RecentTexts", "SuffixAutomaton", "SuffixProposer"]

# A draft from another request continues a suffix of at least this many tokens: shorter
# agreements between two different texts are mostly chance (prose shares "of the" and
# code shares indentation), and their verify rows are paid for nothing. Settled on the
# tune half of `meshnode bench replay` (96 tokens): 4, 6 and 8 gave 2.10, 2.07 and 2.07
# accepted tokens per verify round on its code edits (the n-gram proposer alone 1.77).
HISTORY_MIN_MATCH = 4


class SuffixAutomaton:
    """The suffix automaton of a token sequence, built online (append only).

    ``walk`` feeds a matcher: the longest suffix of a stream that occurs in the text.
    """

    __slots__ = ("tokens", "_next", "_link", "_len", "_end", "_last")

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self._next: list[dict[int, int]] = [{}]
        self._link = [-1]
        self._len = [0]
        self._end = [-1]     # end position of the state's first occurrence
        self._last = 0
        for t in tokens:
            self.extend(t)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_states(self) -> int:
        return len(self._len)

    def extend(self, t: int) -> None:
        nxt, link, ln, end = self._next, self._link, self._len, self._end
        pos = len(self.tokens)
        self.tokens.append(t)
        cur = len(ln)
        ln.append(ln[self._last] + 1)
        nxt.append({})
        link.append(0)
        end.append(pos)
        p = self._last
        while p != -1 and t not in nxt[p]:
            nxt[p][t] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][t]
            if ln[p] + 1 == ln[q]:
                link[cur] = q
            else:
                clone = len(ln)
                ln.append(ln[p] + 1)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                end.append(end[q])
                while p != -1 and nxt[p].get(t) == q:
                    nxt[p][t] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self._last = cur

    def walk(self, state: int, length: int, t: int) -> tuple[int, int]:
        """The matcher after token ``t``: ``(state, length)`` of the longest suffix of the
        stream (ending in ``t``) that occurs in the text; ``(0, 0)`` is none."""
        nxt, link, ln = self._next, self._link, self._len
        while state and t not in nxt[state]:
            state = link[state]
            length = ln[state]
        target = nxt[state].get(t)
        if target is None:
            return 0, 0
        return target, length + 1

    def continuation(self, state: int, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the first occurrence of ``state``'s string,
        stopping at the end of its text (a separator)."""
        start = self._end[state] + 1
        out = []
        for t in self.tokens[start:start + k]:
            if t < 0:
                break
            out.append(t)
        return out


@dataclass
class _Text:
    tokens: tuple[int, ...]
    at: float


class RecentTexts:
    """Per-client recent request texts and their automaton; see the module docstring.

    Thread-safe: :meth:`add` may run on a worker thread while :meth:`automaton` is
    called from the event loop.
    """

    def __init__(self, *, max_clients: int = 16, max_tokens: int = 32768, max_texts: int = 8,
                 max_age_s: float = 600.0) -> None:
        if min(max_clients, max_tokens, max_texts) < 1 or max_age_s <= 0:
            raise ValueError("RecentTexts bounds must be positive")
        self.max_clients, self.max_tokens, self.max_texts, self.max_age_s = (
            max_clients, max_tokens, max_texts, max_age_s)
        self._texts: OrderedDict[str, deque[_Text]] = OrderedDict()   # least recent client first
        self._automata: dict[str, SuffixAutomaton] = {}
        self._lock = threading.Lock()

    @property
    def total_tokens(self) -> int:
        with self._lock:
            return sum(len(t.tokens) for ts in self._texts.values() for t in ts)

    def clients(self) -> list[str]:
        with self._lock:
            return list(self._texts)

    def add(self, client: str, tokens: Sequence[int], now: float) -> None:
        """Remember one finished request's text (prompt + generated) for ``client``, evict
        what the bounds say, and rebuild that client's automaton (O(its tokens))."""
        toks = tuple(int(t) for t in tokens[-self.max_tokens:])
        if not toks:
            return
        with self._lock:
            texts = self._texts.pop(client, None) or deque()
            texts.append(_Text(toks, now))
            self._texts[client] = texts              # most recent client last
            while len(texts) > self.max_texts:
                texts.popleft()
            self._expire(now)
            total = sum(len(t.tokens) for ts in self._texts.values() for t in ts)
            while total > self.max_tokens:           # the oldest text of any client first
                victim = min(self._texts, key=lambda c: self._texts[c][0].at)
                total -= len(self._texts[victim].popleft().tokens)
                if not self._texts[victim]:
                    self._forget(victim)
            while len(self._texts) > self.max_clients:
                self._forget(next(iter(self._texts)))
            snapshot = tuple(self._texts.get(client, ()))
        sam = _build(snapshot) if snapshot else None   # outside the lock: the slow part
        with self._lock:
            if client in self._texts and sam is not None and self._texts[client] and \
                    self._texts[client][-1] is snapshot[-1]:
                self._automata[client] = sam

    def automaton(self, client: str, now: float) -> SuffixAutomaton | None:
        """The automaton over ``client``'s recent texts (newest first), or None."""
        with self._lock:
            self._expire(now)
            return self._automata.get(client)

    def _expire(self, now: float) -> None:
        for c in [c for c, ts in self._texts.items() if now - ts[-1].at > self.max_age_s]:
            self._forget(c)
        for ts in self._texts.values():   # older texts of a live client go at its next add
            while ts and now - ts[0].at > self.max_age_s and len(ts) > 1:
                ts.popleft()

    def _forget(self, client: str) -> None:
        self._texts.pop(client, None)
        self._automata.pop(client, None)


def _build(texts: Sequence[_Text]) -> SuffixAutomaton:
    sam = SuffixAutomaton()
    for i, text in enumerate(reversed(texts)):   # newest first: first occurrence = newest
        for t in text.tokens:
            sam.extend(t)
        sam.extend(-1 - i)                        # unique separator: nothing matches across
    return sam


class SuffixProposer:
    """The request's n-gram proposer plus drafts from recent texts (``history``).

    Same interface as :class:`~meshnode.spec.ngram.NGramProposer` where the serving
    loop uses it (``observe``, ``propose``, ``would_hit``, ``tokens``). Without a
    history it is exactly the n-gram proposer.
    """

    __slots__ = ("ngram", "history", "history_min", "_state", "_length")

    def __init__(self, prompt: Iterable[int] = (), history: SuffixAutomaton | None = None, *,
                 max_n: int = DEFAULT_MAX_N, history_min: int = HISTORY_MIN_MATCH,
                 cursor: bool = True) -> None:
        prompt = [int(t) for t in prompt]
        self.ngram = NGramProposer(prompt, max_n=max_n, cursor=cursor)   # (the prompt is not followed)
        self.history = history if history is not None and len(history) else None
        self.history_min = history_min
        self._state = self._length = 0
        self._walk(prompt)

    def __len__(self) -> int:
        return len(self.ngram)

    @property
    def tokens(self) -> Sequence[int]:
        return self.ngram.tokens

    def observe(self, tokens: Iterable[int]) -> None:
        toks = [int(t) for t in tokens]
        self.ngram.observe(toks)
        self._walk(toks)

    def _walk(self, toks: list[int]) -> None:
        if self.history is not None:
            s, n, walk = self._state, self._length, self.history.walk
            for t in toks:
                s, n = walk(s, n, t)
            self._state, self._length = s, n

    def _history_match(self, after: Sequence[int]) -> tuple[int, int]:
        s, n = self._state, self._length
        if self.history is not None:
            for t in after:
                s, n = self.history.walk(s, n, int(t))
        return s, n

    def propose(self, k: int, *, min_match: int = 1, after: Sequence[int] = ()) -> list[int]:
        """Up to ``k`` drafts: from the context when its match is at least as long as the
        history's (capped at ``max_n``, the context's longest), else from the history."""
        if k <= 0:
            return []
        m = self.ngram.match(after)
        n_ctx = m[0] if m is not None and m[0] >= min_match else 0
        if self.history is not None:
            s, n_hist = self._history_match(after)
            if n_hist >= max(self.history_min, min_match) and n_hist > n_ctx and \
                    min(n_hist, self.ngram.max_n) > n_ctx:
                out = self.history.continuation(s, k)
                if out:
                    return out
        # (the request's own text, also where only its copy cursor has a draft)
        return self.ngram.propose_matched(m, k, min_match=min_match, after=after)

    def would_hit(self, actual_next: int, *, min_match: int = 1) -> bool | None:
        d = self.propose(1, min_match=min_match)
        return None if not d else d[0] == actual_next
