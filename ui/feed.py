"""The UI's memory of node events.

Snapshots describe the node *now*; some views need what happened (speculative windows,
log lines). The app's event worker appends every event here, in arrival order, each
with a sequence number; screens remember the last number they drew and ask for what is
newer, so a screen that was hidden catches up when shown. Buffers are bounded: the
oldest entries fall off. This is presentation state only (no node logic): it never
feeds anything back into the node.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from meshnode.state import DraftVerified, LogEmitted, NodeEvent

T = TypeVar("T")


@dataclass(slots=True)
class _Ring(Generic[T]):
    items: deque[tuple[int, T]]
    total: int = 0

    def add(self, item: T) -> None:
        self.total += 1
        self.items.append((self.total, item))

    def since(self, seq: int) -> Iterator[tuple[int, T]]:
        """Entries with a sequence number above ``seq`` (oldest first)."""
        if seq >= self.total:
            return iter(())
        return ((s, x) for s, x in self.items if s > seq)


def _ring(maxlen: int) -> _Ring:
    return _Ring(deque(maxlen=maxlen))


class EventFeed:
    """Bounded history of drafts, logs and per-strategy acceptance, fed by events."""

    def __init__(self, *, max_drafts: int = 500, max_logs: int = 5000, max_points: int = 240) -> None:
        self.drafts: _Ring[DraftVerified] = _ring(max_drafts)
        self.logs: _Ring[LogEmitted] = _ring(max_logs)
        self._acceptance: dict[str, deque[float]] = {}
        self._max_points = max_points
        self.events_seen = 0

    def add(self, event: NodeEvent) -> None:
        self.events_seen += 1
        match event:
            case DraftVerified():
                self.drafts.add(event)
                hist = self._acceptance.setdefault(event.strategy, deque(maxlen=self._max_points))
                n = len(event.proposed)
                hist.append(event.n_accepted / n if n else 0.0)
            case LogEmitted():
                self.logs.add(event)
            case _:
                # Peer, stage and request changes also show in the next snapshot.
                pass

    def acceptance(self) -> dict[str, list[float]]:
        """Acceptance ratio of each recent window, per strategy, oldest first."""
        return {name: list(hist) for name, hist in sorted(self._acceptance.items())}
