"""Prefix reuse across requests: which retained session a new prompt can start from.

Theory of operation
-------------------
Editors and chat clients resend what they sent before (the same file, the conversation
so far) with every request. Instead of freeing a finished request's session on every
stage, the model server may *retain* it here: its session id and the tokens whose KV it
really holds (the prompt and the generated tokens that were fed, never the last sampled
token nor rejected drafts). A later request whose prompt begins with
:data:`MIN_PREFIX` or more of those tokens copies that many positions of KV into its own
new session on every stage (``Pipeline.copy_session``) and prefills only the rest. On
CPU stages the engine computes a row the same in any chunk, so the copied KV equals what
a cold prefill would compute and the answer is exactly a cold run's.

On a GPU stage a row's values depend on the call it is computed in (llama.cpp picks its
kernels, and their order of summation, by the call's row count; measured: warm answers
differed from cold ones). A cold prompt is prefilled in chunks of ``n_batch`` from
position 0, so there the lookup copies a multiple of ``n_batch`` (``align``) positions,
and no more than the entry's prompt (``Retained.prefilled``: its generated tokens'
rows came from decode steps, not chunks): the positions copied came from the very
chunks a cold prefill computes, and the rest is prefilled in those chunks too.

A prompt that is *scored* (OpenAI's ``echo`` with logprobs: what an evaluation harness
sends, the same context once per answer choice) needs the logprob of each of its tokens,
and a copied prefix computes no logits. So a scored request's session is retained with
its prompt's scores (tokens 1..P-1, with the alternatives it asked for), and a scored
request takes an entry's scores with its KV. Copying ``n`` positions takes the scores
of tokens 1..n; token ``n``'s score came from the row before it, computed for the
entry's own token ``n``, so ``n`` stays below the number of tokens both prompts share
(and within the entry's scores). An entry kept without scores, or with fewer
alternatives than asked for, is no use to a scored request.

A retained session costs a sequence slot on every stage, so the cache holds at most
``capacity`` sessions (the model server sets it below its ``parallel`` slots, so a match
can always be copied into a free slot), evicts the least recently used one first, and
gives up any unpinned session at once when a live request needs its slot. An entry is
*pinned* while a request copies from it (not evicted under the copy). Entries remember
the route epoch they were computed on: after a failover their KV is gone (or on the old
route) and :meth:`PrefixCache.drop_stale` forgets them.

This module holds no I/O: it decides, the model server frees the sessions it returns.
The lookup compares the prompt with each entry (numpy, O(n_ctx) per entry), and entries
are few (at most ``parallel - 1``), so its cost is bounded without a trie.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from meshnode.mesh.logprobs import TokenLogprobs

# Shorter shared prefixes are not worth a session copy (a whole KV stream on each stage)
# and would keep sessions for chat templates' common headers alone.
MIN_PREFIX = 32


@dataclass(eq=False)
class Retained:
    """A finished request's session kept for its KV: positions [0, len(tokens))."""

    session: int
    tokens: np.ndarray          # int32, exactly the tokens whose KV the session holds
    epoch: int                  # the route it was computed on (RouteGate.epoch)
    pins: int = 0               # requests copying from it now
    # a scored prompt's tokens 1..k (k < len(tokens)), with score_top alternatives each
    scores: TokenLogprobs | None = None
    score_top: int = 0
    removed: bool = False       # handed back to be freed: never copy from it again
    # positions [0, prefilled) came from prompt chunks (from position 0, n_batch each);
    # the rest from decode steps (what a lookup with ``align`` may copy: module docstring)
    prefilled: int = 0


@dataclass
class PrefixStats:
    lookups: int = 0            # requests that looked for a prefix
    hits: int = 0               # ... and reused one
    tokens_reused: int = 0      # prompt tokens not prefilled thanks to it
    taken: int = 0              # kept sessions a live request took over whole (no copy)
    retained: int = 0           # sessions kept at a request's end
    evicted: int = 0            # sessions given up (LRU, for a live request, dominated, stale)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


@dataclass
class PrefixCache:
    """Retained sessions, least recently used first. See the module docstring."""

    capacity: int
    min_prefix: int = MIN_PREFIX
    stats: PrefixStats = field(default_factory=PrefixStats)
    _entries: OrderedDict[int, Retained] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._entries)

    def sessions(self) -> list[int]:
        return list(self._entries)

    def lookup(self, prompt: Sequence[int] | np.ndarray, epoch: int,
               scored: int | None = None, align: int = 1) -> tuple[Retained, int] | None:
        """The entry sharing the longest prefix with ``prompt`` (at least ``min_prefix``
        tokens, at most ``len(prompt) - 1``: one token is left to prefill for the first
        token's logits) and that length, the entry pinned; None when none qualifies.
        ``scored``: the prompt is scored with that many alternatives, so only entries
        with scores for as many alternatives qualify, up to the tokens they scored.
        ``align`` > 1 (a route with a GPU stage: the prefill chunk): the length is a
        multiple of it, within the entry's prefilled positions."""
        if self.capacity <= 0:
            return None
        self.stats.lookups += 1
        arr = np.asarray(prompt, dtype=np.int32)
        best: tuple[Retained, int] | None = None
        for e in self._entries.values():
            if e.epoch != epoch:
                continue
            common = common_prefix(arr, e.tokens)
            n = min(common, len(arr) - 1)
            if scored is not None:
                if e.scores is None or e.score_top < scored:
                    continue
                # the last copied token's score is the entry's: that token must be shared
                n = min(n, len(e.scores.logprobs), common - 1)
            if align > 1:
                n = min(n, e.prefilled) // align * align
            if n >= self.min_prefix and (best is None or n > best[1]):
                best = (e, n)
        if best is not None:
            best[0].pins += 1
            self._entries.move_to_end(best[0].session)
        return best

    def used(self, entry: Retained, n: int) -> None:
        """``n`` tokens of ``entry`` were copied into a new session (telemetry)."""
        self.stats.hits += 1
        self.stats.tokens_reused += n

    def unpin(self, entry: Retained) -> None:
        entry.pins = max(0, entry.pins - 1)

    def evict_one(self, keep: Retained | None = None) -> Retained | None:
        """Remove the least recently used unpinned entry other than ``keep`` (to free its
        slot for a live request); None when there is none."""
        for e in self._entries.values():
            if e.pins == 0 and e is not keep:
                return self._remove(e)
        return None

    def put(self, session: int, tokens: Sequence[int] | np.ndarray, epoch: int,
            scores: TokenLogprobs | None = None, score_top: int = 0, prefilled: int = 0) -> list[Retained]:
        """Retain ``session`` holding KV of ``tokens`` (with ``scores``: its first tokens'
        scores, ``score_top`` alternatives each; ``prefilled``: how many of its positions
        came from prompt chunks). Returns the entries to free: those
        the new one makes useless (unpinned, their tokens a prefix of the new ones and
        their scores no more than the new ones': every match they would give, it gives
        as long), then the least recently used beyond ``capacity`` -- the new one itself
        when it cannot be kept (too short, no room)."""
        arr = np.array(tokens, dtype=np.int32)
        new = Retained(session, arr, epoch, scores=scores, score_top=score_top, prefilled=prefilled)
        if self.capacity <= 0 or len(arr) < self.min_prefix:
            return [new]
        out = [self._remove(e) for e in list(self._entries.values())
               if e.pins == 0 and _covers(new, e)]
        while len(self._entries) >= self.capacity:
            e = self.evict_one()
            if e is None:
                out.append(new)   # every entry is being copied from: no room
                return out
            out.append(e)
        self._entries[session] = new
        self.stats.retained += 1
        return out

    def take(self, entry: Retained) -> None:
        """Hand ``entry``'s session over to a live request (its KV and its slot): it
        leaves the cache without being freed."""
        del self._entries[entry.session]
        entry.removed = True
        self.stats.taken += 1

    def drop_stale(self, epoch: int) -> list[Retained]:
        """Forget the entries of other routes than ``epoch`` (pinned too: a request copies
        only from an entry of its own route's epoch)."""
        return [self._remove(e) for e in list(self._entries.values()) if e.epoch != epoch]

    def clear(self) -> list[Retained]:
        return [self._remove(e) for e in list(self._entries.values())]

    def _remove(self, e: Retained) -> Retained:
        del self._entries[e.session]
        e.removed = True
        self.stats.evicted += 1
        return e


def _covers(new: Retained, old: Retained) -> bool:
    """Whether every match ``old`` gives, ``new`` gives as long (so ``old`` is no use)."""
    if (len(old.tokens) > len(new.tokens) or common_prefix(old.tokens, new.tokens) != len(old.tokens)
            or old.prefilled > new.prefilled):
        return False
    if old.scores is None:
        return True
    return (new.scores is not None and new.score_top >= old.score_top
            and len(new.scores.logprobs) >= len(old.scores.logprobs))
