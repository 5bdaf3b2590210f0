"""Speculative-decoding telemetry: counters per request and for the whole model.

Theory of operation: stage 0 reports every step it runs: a prompt (prefill), a plain
decode step, or a verify window (drafts proposed, how many were accepted, the bonus
token, the step's seconds). :class:`SpecTelemetry` folds them into counters for the
request and for the model, keeps the last few windows in a bounded deque for the TUI
(``DraftVerified`` events are built from them by the node, which owns the
detokenizer), and produces :class:`meshnode.state.SpecStats` snapshots and the
per-request counters that the node puts in each response's ``timings``
(:class:`meshnode.serve.client.Timings`).

Durations are passed in (seconds, measured by the caller's clock); nothing here
reads a clock. A lock makes snapshots safe to take from another thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from meshnode.state import SpecState, SpecStats

__all__ = ["DraftRecord", "SpecCounters", "SpecTelemetry"]


@dataclass(frozen=True, slots=True)
class DraftRecord:
    """One verify window, for display: ``proposed`` ids, the first ``n_accepted`` kept."""

    request_id: str
    proposed: tuple[int, ...]
    n_accepted: int
    bonus: int
    verify_ms: float


@dataclass(slots=True)
class SpecCounters:
    """Mutable counters (one per request, one overall). Times are in seconds."""

    prompt_n: int = 0
    prompt_s: float = 0.0
    predicted_n: int = 0
    predicted_s: float = 0.0
    proposed: int = 0           # draft tokens sent for verification
    accepted: int = 0           # ... of which kept
    windows: int = 0            # verify steps
    verify_s: float = 0.0       # total time of verify steps
    plain_steps: int = 0
    lookahead: int = 0          # lookahead windows sent (meshnode.spec.lookahead)
    lookahead_used: int = 0     # ... whose guess held
    model_windows: int = 0      # windows drafted by the draft model (the rest: n-gram)
    model_proposed: int = 0     # ... their drafts
    model_accepted: int = 0     # ... of which kept

    @property
    def rejected(self) -> int:
        return self.proposed - self.accepted

    @property
    def acceptance(self) -> float:
        """accepted / proposed (llama.cpp's "draft acceptance rate")."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def verify_ms_mean(self) -> float:
        return 1000.0 * self.verify_s / self.windows if self.windows else 0.0


class SpecTelemetry:
    """Counters of one model's speculative decoding on stage 0.

    ``strategy`` is the name shown to users ("ngram", "draft", "none"); ``recent``
    bounds the deque of recent windows.
    """

    def __init__(self, strategy: str, *, state: SpecState = SpecState.COLD, recent: int = 32):
        self.strategy = strategy
        self._state = state
        self._window = 0
        self._total = SpecCounters()
        self._requests: dict[str, SpecCounters] = {}
        self._recent: deque[DraftRecord] = deque(maxlen=recent)
        self._lock = threading.Lock()

    # ---- recording ----------------------------------------------------------

    def _req(self, request_id: str) -> SpecCounters:
        c = self._requests.get(request_id)
        if c is None:
            c = self._requests[request_id] = SpecCounters()
        return c

    def set_state(self, state: SpecState) -> None:
        with self._lock:
            self._state = state

    def set_window(self, window: int) -> None:
        with self._lock:
            self._window = window

    def record_prompt(self, request_id: str, n_tokens: int, seconds: float) -> None:
        """The prompt of ``request_id`` was prefilled (``n_tokens`` evaluated)."""
        with self._lock:
            for c in (self._req(request_id), self._total):
                c.prompt_n += n_tokens
                c.prompt_s += seconds

    def record_plain(self, request_id: str, seconds: float, n_tokens: int = 1) -> None:
        """A plain decode step emitted ``n_tokens`` (normally 1)."""
        with self._lock:
            for c in (self._req(request_id), self._total):
                c.predicted_n += n_tokens
                c.predicted_s += seconds
                c.plain_steps += 1

    def record_window(
        self,
        request_id: str,
        proposed: Sequence[int],
        n_accepted: int,
        bonus: int,
        seconds: float,
        by_model: bool = False,
    ) -> DraftRecord:
        """A verify window: ``n_accepted`` of ``proposed`` kept, then ``bonus``;
        ``by_model``: drafted by the draft model (else by the n-gram proposer).

        Returns the record (the node turns it into a ``DraftVerified`` event).
        """
        if not 0 <= n_accepted <= len(proposed):
            raise ValueError(f"n_accepted {n_accepted} outside [0, {len(proposed)}]")
        rec = DraftRecord(request_id, tuple(int(t) for t in proposed), n_accepted, int(bonus),
                          1000.0 * seconds)
        with self._lock:
            for c in (self._req(request_id), self._total):
                c.proposed += len(proposed)
                c.accepted += n_accepted
                c.windows += 1
                c.verify_s += seconds
                c.predicted_n += n_accepted + 1
                c.predicted_s += seconds
                if by_model:
                    c.model_windows += 1
                    c.model_proposed += len(proposed)
                    c.model_accepted += n_accepted
            self._recent.append(rec)
        return rec

    def record_lookahead(self, request_id: str, used: bool) -> None:
        """A lookahead window was sent; ``used``: its guess held (it became the next window)."""
        with self._lock:
            for c in (self._req(request_id), self._total):
                c.lookahead += 1
                c.lookahead_used += int(used)

    def end_request(self, request_id: str) -> SpecCounters:
        """Forget ``request_id``; returns its final counters (zeros if unknown)."""
        with self._lock:
            return self._requests.pop(request_id, None) or SpecCounters()

    # ---- reading ------------------------------------------------------------

    def _stats(self, c: SpecCounters) -> SpecStats:
        return SpecStats(
            strategy=self.strategy,
            state=self._state,
            proposed=c.proposed,
            accepted=c.accepted,
            windows=c.windows,
            current_window=self._window,
            verify_ms=c.verify_ms_mean,
            lookahead=c.lookahead,
            lookahead_used=c.lookahead_used,
        )

    def snapshot(self) -> SpecStats:
        """Overall stats since this telemetry was created."""
        with self._lock:
            return self._stats(self._total)

    def request_stats(self, request_id: str) -> SpecStats:
        with self._lock:
            return self._stats(self._requests.get(request_id) or SpecCounters())

    def counters(self, request_id: str | None = None) -> SpecCounters:
        """A copy of the raw counters (overall when ``request_id`` is None)."""
        with self._lock:
            c = self._total if request_id is None else self._requests.get(request_id)
            if c is None:
                return SpecCounters()
            return replace(c)

    def recent(self) -> tuple[DraftRecord, ...]:
        """The most recent verify windows, oldest first."""
        with self._lock:
            return tuple(self._recent)
