"""When and how much a draft model catches up on a request's context.

Theory of operation. A draft model (``spec/draft.py``) must have decoded a request's
context before it can propose: the prompt when the request starts, the tokens of plain
decoding when a cooldown ends. That catch-up runs on stage 0's compute thread, where
the target's own steps run too, and costs what prefilling that context in the draft
costs: a few milliseconds on a GPU, as much as the target's own prefill for a draft as
big as the target on a CPU.

- On a split stage 0's compute thread idles while a step is at the other stages, so
  the draft catches up there, a *piece* at a time. A piece still running when its
  step's result comes back makes the next step wait: the next piece is half as big.
  One that was done grows the next by a quarter (AIMD: pieces settle just under the
  time a step is away). A request whose context the draft would not have caught up
  on, at that pace, before the answer's ``max_tokens`` drafts by n-gram alone; so does
  every request once even a one-row piece outlasts a step (the pace is 0 rows), but
  for a probe at every PROBE_EVERY-th such request.
- On one node nothing hides a catch-up: the request waits for it. Once the seconds a
  caught-up row takes are known, a request takes the draft only when catching up on
  its context costs at most ``one_node_share`` of decoding the rest of its answer
  plainly.
- ``--spec-mode on`` pins drafting on, the catch-up with it: always, all at once.

:class:`CatchUpPace` holds what was learned (piece size, seconds a row) and answers;
``serve/speculation.py`` runs the pieces. Pure logic: no I/O, no clock.
"""

from __future__ import annotations

__all__ = ["CatchUpPace"]

FIRST_ROWS = 16          # the first piece, before anything is known
MAX_ROWS = 512           # the biggest piece
MIN_RATE_ROWS = 8        # a catch-up of fewer rows measures per-call costs, not a rate
ONE_NODE_SHARE = 0.5     # of plain decoding the rest of the answer, at most, on one node
PROBE_EVERY = 32         # requests refused at a pace of 0 rows before one probes again


class CatchUpPace:
    """A draft model's catch-up pace on one node's route (module docstring)."""

    __slots__ = ("rows", "row_s", "one_node_share", "pinned", "_refused")

    def __init__(self, *, first_rows: int = FIRST_ROWS, one_node_share: float = ONE_NODE_SHARE,
                 pinned: bool = False) -> None:
        if first_rows < 1 or one_node_share <= 0:
            raise ValueError("catch-up pieces need at least one row and a positive share")
        self.pinned = pinned                # drafting pinned on: always catch up, all at once
        self.rows = first_rows              # rows of the next piece on a split (0: none fits)
        self.row_s: float | None = None     # seconds one caught-up row takes (EWMA)
        self.one_node_share = one_node_share
        self._refused = 0                   # requests refused at 0 rows since the last probe

    def refusal(self, lag: int, remaining: int, *, split: bool, plain_s: float | None) -> str | None:
        """Why the draft should not catch up on ``lag`` tokens for an answer with
        ``remaining`` tokens left (a step of plain decoding taking ``plain_s``), or
        None when it should."""
        if self.pinned:
            return None
        if split:
            if self.rows == 0:
                self._refused += 1
                if self._refused < PROBE_EVERY:
                    return "even one row outlasts a step's time at the other stages"
                self.rows, self._refused = 1, 0     # probe: conditions change
            if lag <= self.rows * remaining:
                return None
            return f"{lag} tokens in pieces of {self.rows} while steps are away, {remaining} steps left"
        row_s = self.row_s
        if row_s is None or plain_s is None or lag * row_s <= self.one_node_share * remaining * plain_s:
            return None
        return f"{lag} tokens at {1e3 * row_s:.2f} ms each, against {remaining} tokens left at {1e3 * plain_s:.1f} ms"

    @property
    def piece_rows(self) -> int | None:
        """Rows of the next piece on a split (None: the whole lag at once, when pinned)."""
        return None if self.pinned else self.rows

    def piece_ended(self, overran: bool) -> None:
        """The step a piece ran beside came back: ``overran`` when the piece still ran."""
        self.rows = self.rows // 2 if overran else min(MAX_ROWS, self.rows + max(1, self.rows // 4))

    def caught_up(self, rows: int, seconds: float) -> None:
        """A catch-up decoded ``rows`` rows in ``seconds``."""
        if rows > MIN_RATE_ROWS:
            rate = seconds / rows
            self.row_s = rate if self.row_s is None else self.row_s + 0.25 * (rate - self.row_s)
