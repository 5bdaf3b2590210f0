"""Where a decode token's time goes in a split, from the nodes' own marks.

Each node of a configuration runs with ``$MESHNODE_TIMELINE`` (:mod:`meshnode.timeline`)
and writes its marks when it stops. One plain decode step of one stream is a chain of
marks across the route's nodes, all on the machine's one monotonic clock::

    stage 0:  dec< dec> send< send>                                  recv< recv>  dec< (next step)
    stage 1:                        recv< recv> dec< dec> send< send>

:func:`token_path` follows that chain for every step whose frames took the fast lane
(the only frames marked on the wire side) and reports the median of each piece: each
stage's compute, its Python before and after it, and each hop: from the sender's
``sendto`` to the receiver's first mark (the socket calls, the kernel, and the receiver
waking up or finishing something else first). The pieces of a step add up to the step.
Steps of a batch of several sessions or with several llama.cpp calls are not one-stream
decode steps; the bench limits the marks to its one-stream runs (``windows``).
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["TokenPath", "load_marks", "token_path"]

Marks = Sequence[tuple[int, str]]
Span = tuple[int, int]

# one step over a span longer than this is not a decode step of a live stream
MAX_STEP_NS = 2_000_000_000


@dataclass
class TokenPath:
    """Medians in microseconds over ``steps`` decode steps: ``total`` from one step's
    compute on stage 0 to the next one's, and its ``pieces`` in the order they happen."""

    steps: int
    total_us: float
    pieces: list[tuple[str, float]] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"steps": self.steps, "total_us": round(self.total_us, 1),
                "pieces": [[name, round(us, 1)] for name, us in self.pieces]}

    @classmethod
    def from_dict(cls, d: dict) -> "TokenPath":
        return cls(int(d["steps"]), float(d["total_us"]), [(str(a), float(b)) for a, b in d["pieces"]])

    def line(self) -> str:
        parts = " + ".join(f"{name} {us:.0f}" for name, us in self.pieces)
        return f"{self.total_us:.0f} us (median of {self.steps} steps) = {parts}"


def load_marks(folder: Path) -> list[tuple[int, str]]:
    """The marks one node process wrote into ``folder`` (empty when it wrote none)."""
    marks: list[tuple[int, str]] = []
    for path in sorted(folder.glob("*.json")):
        try:
            marks.extend((int(t), str(tag)) for t, tag in json.loads(path.read_text())["marks"])
        except (OSError, ValueError, KeyError, TypeError):
            continue   # a node killed mid-write: its marks are missing, not wrong
    marks.sort()
    return marks


class _Spans:
    """The ``tag<`` .. ``tag>`` spans of one node, by start time."""

    def __init__(self, marks: Marks, tag: str) -> None:
        self.spans: list[Span] = []
        start = None
        for t, k in marks:
            if k == tag + "<":
                start = t           # an unclosed span (e.g. a probe's receive) is replaced
            elif k == tag + ">" and start is not None:
                self.spans.append((start, t))
                start = None
        self.starts = [a for a, _ in self.spans]

    def first_after(self, t: int) -> Span | None:
        i = bisect.bisect_left(self.starts, t)
        return self.spans[i] if i < len(self.spans) else None


def token_path(nodes: Sequence[Marks], windows: Sequence[Span] = ()) -> TokenPath | None:
    """The median token path of the decode steps whose stage-0 compute starts inside one
    of ``windows`` (all of them when none given). ``nodes`` are the route's nodes in
    stage order, stage 0 (the coordinator) first. None when no step was found."""
    dec = [_Spans(m, "dec") for m in nodes]
    send = [_Spans(m, "send") for m in nodes]
    recv = [_Spans(m, "recv") for m in nodes]
    n = len(nodes)
    names = _piece_names(n)
    rows: list[list[int]] = []
    totals: list[int] = []
    for d in dec[0].spans:
        if windows and not any(a <= d[0] <= b for a, b in windows):
            continue
        nxt = dec[0].first_after(d[1])
        if nxt is None:
            break
        row = _step(d, nxt, dec, send, recv, n)
        if row is not None and 0 < nxt[0] - d[0] < MAX_STEP_NS:
            rows.append(row)
            totals.append(nxt[0] - d[0])
    if not rows:
        return None
    pieces = [(name, statistics.median(col) / 1e3) for name, col in zip(names, zip(*rows))]
    return TokenPath(len(rows), statistics.median(totals) / 1e3, pieces)


def _step(d: Span, nxt: Span, dec, send, recv, n: int) -> list[int] | None:
    """The pieces (ns) of the step computed in ``d`` on stage 0, or None when its marks
    do not form one lane step (a prefill chunk, a step sent over a stream, a lost frame).
    The pieces follow the critical path and add up to the step: a hop runs from the
    sender's ``sendto`` call to the receiver's first mark (a receiver may even start
    before the sender's call returns: on a busy machine the sender is preempted in it)."""
    if n == 1:
        return [d[1] - d[0], nxt[0] - d[1]]
    out = [d[1] - d[0]]
    s = send[0].first_after(d[1])
    if s is None or s[0] > nxt[0]:
        return None
    out.append(s[0] - d[1])
    for i in range(1, n):
        r = recv[i].first_after(s[0])
        c = dec[i].first_after(r[1]) if r else None
        s2 = send[i].first_after(c[1]) if c else None
        if s2 is None or s2[0] > nxt[0]:
            return None
        out += [r[0] - s[0], r[1] - r[0], c[0] - r[1], c[1] - c[0], s2[0] - c[1]]
        s = s2
    back = recv[0].first_after(s[0])
    if back is None or back[1] > nxt[0]:
        return None
    out += [back[0] - s[0], back[1] - back[0], nxt[0] - back[1]]
    return out


def _piece_names(n: int) -> list[str]:
    if n == 1:
        return ["compute", "between steps"]
    names = ["s0 compute", "s0 to send"]
    for i in range(1, n):
        names += [f"hop to s{i}", f"s{i} receive", f"s{i} queue", f"s{i} compute", f"s{i} to send"]
    return names + ["hop to s0", "s0 receive", "s0 to next step"]
