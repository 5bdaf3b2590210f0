"""When to speculate: the auto policy (drafting on, off, probing, the measured gate).

Theory of operation.

*Auto policy* (n-gram ``auto`` mode), one state machine per model on stage 0::

    COLD --prompt affinity >= enable / repeated would-be hits--> ENABLED
    ENABLED --acceptance too low to pay, after min_windows--> COOLING_DOWN
    COOLING_DOWN --cooldown tokens generated--> COLD        (probe again)
    ENABLED --new prompt without affinity--> COLD
    OFF: mode "off" (never leaves); mode "on" pins ENABLED.

A proposer that cannot be watched for free (a draft model) has no COLD phase
(``observes=False``): a cooldown ends in ENABLED (a probe), and auto starts ENABLED once
plain steps have been measured on this route; before that it decodes ``measure_tokens``
tokens plainly (a short COOLING_DOWN), since a draft that drafts at every step would
leave nothing to judge its windows against but the acceptance floor.

COLD costs nothing: the node decodes plainly and asks the proposer, before each
token arrives, whether it *would* have drafted it (``NGramProposer.would_hit``).
Acceptance is judged per draft position (accepted / positions examined, where the
rejected position counts and the positions after it do not), not as accepted /
proposed: the latter falls with the window size even when every examined draft is
likely right, and would switch off exactly the windows that pay most. Each failure
doubles the cooldown (up to a cap); a healthy stretch of ``judge_windows`` windows
forgives past failures. Every transition goes through ``AutoPolicy._set_state``,
which logs it.

"Too low to pay" is ``acceptance < disable_below`` (0.45), and, once plain steps have
been measured on this route, also "drafting did not beat plain decoding by
``pay_margin``": where a verify row costs almost nothing (a GPU, a memory-bound big
model) drafting pays at acceptances far below 0.45 and the fixed floor decides; where it
costs half a step (one CPU thread, a small model) drafting at 0.5 acceptance loses, and
the measured times decide. The gate judges what drafting *did*: the tokens the judged
windows yielded over the seconds they took (each window's wall time as the caller
measured it), against a plain step's measured seconds. A model of it (the geometric
``E(k)`` over :class:`CostModel` costs) undercounts what copy-heavy answers get (long
accepted runs, lookahead windows that overlap the window before them): on code edits it
said "pays at most 1.02x" of windows that were yielding 1.3-2x, and switched them off.
The model is only the fallback for windows reported without their time. The gate never
switches on drafting the floor would refuse.

How far to speculate is not decided here: the window policy lives in
:mod:`meshnode.spec.window`, the cost model in :mod:`meshnode.spec.cost_model`.

Pure logic: no clock (callers pass measured seconds), no I/O.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from meshnode.spec.cost_model import CostModel
from meshnode.state import SpecState

__all__ = [
    "AutoPolicy",
    "AutoPolicyParams",
    "prompt_affinity",
]

log = logging.getLogger(__name__)

Mode = Literal["auto", "on", "off"]


# ---- prompt affinity ----------------------------------------------------------


def prompt_affinity(prompt_tokens: Sequence[int], n: int = 3) -> float:
    """Fraction of the prompt's n-gram positions whose n-gram already occurred earlier.

    High for code, diffs, edits and templated text (the answer tends to copy spans),
    near 0 for prose in a large vocabulary. O(len(prompt)). Returns 0.0 when the
    prompt is shorter than ``n`` tokens.
    """
    toks = list(prompt_tokens)
    total = len(toks) - n + 1
    if total <= 0:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for i in range(total):
        g = tuple(toks[i : i + n])
        if g in seen:
            repeats += 1
        else:
            seen.add(g)
    return repeats / total


# ---- auto policy --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AutoPolicyParams:
    affinity_n: int = 3                 # n-gram length for prompt_affinity
    affinity_enable: float = 0.30       # enable at once when the prompt scores this much
    affinity_min_tokens: int = 32       # shorter prompts are not judged by affinity
    cold_window: int = 16               # recent cold observations considered
    cold_hits_to_enable: int = 4        # ... of which this many would have hit
    cold_enable_rate: float = 0.5       # ... at this rate at least
    disable_below: float = 0.45         # per-token acceptance under which we back off
    pay_margin: float = 0.10            # drafting must beat plain decoding by this (measured)
    min_windows: int = 8                # verify windows before judging acceptance
    judge_windows: int = 16             # sliding window of verify outcomes judged
    cooldown_tokens: int = 64           # first cooldown, in generated tokens
    cooldown_growth: float = 2.0        # each further failure multiplies it
    cooldown_max_tokens: int = 2048
    measure_tokens: int = 4             # plain tokens before a draft model's first window


class AutoPolicy:
    """Decides, step by step, whether stage 0 drafts (ENABLED) or decodes plainly.

    Caller protocol, per request: :meth:`on_prompt`; then each step, if
    :attr:`should_draft` verify a window and :meth:`record_verify`; else, if
    :attr:`should_observe`, :meth:`record_cold` with the proposer's would-hit answer;
    always :meth:`on_generated` with the number of tokens emitted.

    ``observes=False`` is for proposers that cannot be watched for free (a draft model
    costs a forward pass per guess): there is no COLD phase. Auto mode starts ENABLED
    (after ``measure_tokens`` plain tokens when ``cost`` has no plain step yet), ignores
    prompt shape, and probes again *by drafting* when a cooldown ends; the judgement
    (floor, realized gain, cooldowns) is the same.
    """

    def __init__(
        self,
        mode: Mode = "auto",
        params: AutoPolicyParams | None = None,
        *,
        name: str = "ngram",
        on_transition: Callable[[SpecState, SpecState, str], None] | None = None,
        cost: CostModel | None = None,
        observes: bool = True,
    ) -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"mode must be auto, on or off, got {mode!r}")
        self.mode: Mode = mode
        self.params = params or AutoPolicyParams()
        self.name = name
        self.cost = cost
        self.observes = observes
        self._on_transition = on_transition
        cold = SpecState.COLD if observes else SpecState.ENABLED
        self._state = {"auto": cold, "on": SpecState.ENABLED, "off": SpecState.OFF}[mode]
        self._cold: deque[bool] = deque(maxlen=self.params.cold_window)
        # (proposed, accepted, seconds or None) of the latest verify windows
        self._verifies: deque[tuple[int, int, float | None]] = deque(maxlen=self.params.judge_windows)
        self._failures = 0
        self._cooldown_left = 0
        if (self._state is SpecState.ENABLED and mode == "auto" and cost is not None
                and cost.plain_s is None and self.params.measure_tokens > 0):
            # measure plain steps first: what this drafting is judged against
            self._state, self._cooldown_left = SpecState.COOLING_DOWN, self.params.measure_tokens
        self.last_affinity: float | None = None

    # ---- queries ------------------------------------------------------------

    @property
    def state(self) -> SpecState:
        return self._state

    @property
    def should_draft(self) -> bool:
        return self._state is SpecState.ENABLED

    @property
    def should_observe(self) -> bool:
        """True while COLD: feed :meth:`record_cold` (free would-be-hit counting)."""
        return self._state is SpecState.COLD

    @property
    def cooldown_left(self) -> int:
        return self._cooldown_left

    @property
    def failures(self) -> int:
        return self._failures

    @property
    def acceptance(self) -> float | None:
        """Per-token acceptance over the judged verify windows (None before any)."""
        hits = trials = 0
        for proposed, accepted, _ in self._verifies:
            hits += accepted
            trials += accepted + (1 if accepted < proposed else 0)
        return hits / trials if trials else None

    # ---- events -------------------------------------------------------------

    def on_prompt(self, prompt_tokens: Sequence[int], *, predicted: bool = False) -> float:
        """A new request starts; returns its prompt affinity score.

        High affinity, or a request that brings its predicted output (``predicted``),
        enables drafting at once (also out of COOLING_DOWN: a new prompt of the right
        shape is new evidence); otherwise an ENABLED policy goes back to COLD to observe
        the new request before paying for verifies.
        """
        p = self.params
        score = prompt_affinity(prompt_tokens, p.affinity_n)
        self.last_affinity = score
        if self.mode != "auto" or not self.observes:
            return score
        self._cold.clear()
        if predicted or (len(prompt_tokens) >= p.affinity_min_tokens and score >= p.affinity_enable):
            if self._state is not SpecState.ENABLED:
                self._set_state(SpecState.ENABLED, "the request predicts its output" if predicted
                                else f"prompt affinity {score:.2f}")
            else:
                self._verifies.clear()
        elif self._state is SpecState.ENABLED:
            self._set_state(SpecState.COLD, f"new prompt, affinity {score:.2f}")
        return score

    def record_cold(self, hit: bool | None) -> None:
        """While COLD: would a draft have predicted the token just generated?

        ``None`` (the proposer had nothing to propose) is not counted: no draft, no cost.
        """
        if self._state is not SpecState.COLD or hit is None:
            return
        self._cold.append(bool(hit))
        hits = sum(self._cold)
        p = self.params
        if hits >= p.cold_hits_to_enable and hits / len(self._cold) >= p.cold_enable_rate:
            self._set_state(SpecState.ENABLED, f"{hits}/{len(self._cold)} would-be hits")

    @property
    def realized_gain(self) -> float | None:
        """Tokens per second of the judged verify windows over plain decoding's: what
        drafting actually did here (> 1: it paid). None unless every judged window came
        with its seconds and the cost model has measured plain steps."""
        plain_s = self.cost.plain_s if self.cost is not None else None
        if not plain_s or not self._verifies:
            return None
        tokens = seconds = 0.0
        for _, accepted, s in self._verifies:
            if s is None:
                return None
            tokens += accepted + 1
            seconds += s
        return tokens * plain_s / seconds if seconds > 0 else None

    def record_verify(self, proposed: int, accepted: int, seconds: float | None = None) -> None:
        """One verify window came back: ``accepted`` of ``proposed`` drafts kept, after
        ``seconds`` of wall time (the whole step as the stream waited for it; None when
        not measured: the gate then falls back to the cost model's expectation)."""
        if proposed <= 0 or self._state is not SpecState.ENABLED:
            return
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted ({accepted}) must be in [0, proposed={proposed}]")
        if seconds is not None and not seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        self._verifies.append((proposed, accepted, seconds))
        if self.mode != "auto":
            return
        p = self.params
        rate = self.acceptance
        if rate is None or len(self._verifies) < p.min_windows:
            return
        why = self._too_low(rate)
        if why:
            cooldown = min(
                p.cooldown_max_tokens,
                int(p.cooldown_tokens * p.cooldown_growth ** self._failures),
            )
            self._failures += 1
            self._cooldown_left = cooldown
            self._set_state(
                SpecState.COOLING_DOWN,
                f"{why} over {len(self._verifies)} windows; "
                f"cooling down for {cooldown} tokens (failure {self._failures})",
            )
        elif len(self._verifies) >= p.judge_windows and self._failures:
            self._failures = 0  # a healthy stretch forgives earlier failures

    def _too_low(self, rate: float) -> str:
        """Why acceptance ``rate`` does not pay on this route ('' when it does)."""
        p = self.params
        if rate < p.disable_below:
            return f"acceptance {rate:.2f} < {p.disable_below}"
        realized = self.realized_gain
        if realized is not None:
            if realized < 1.0 + p.pay_margin:
                return (f"acceptance {rate:.2f}, drafting ran at {realized:.2f}x plain "
                        f"decoding here (needs {1.0 + p.pay_margin:.2f}x)")
            return ""
        cost = self.cost
        if cost is not None and cost.measured:
            gain = cost.speedup(cost.best_window(rate), rate)
            if gain < 1.0 + p.pay_margin:
                return (f"acceptance {rate:.2f} pays at most {gain:.2f}x here "
                        f"(verify of 1 draft costs {cost.relative(1):.2f} plain steps)")
        return ""

    def on_generated(self, n_tokens: int) -> None:
        """``n_tokens`` were emitted (any state); counts down a cooldown."""
        if self._state is not SpecState.COOLING_DOWN or n_tokens <= 0:
            return
        self._cooldown_left = max(0, self._cooldown_left - n_tokens)
        if self._cooldown_left == 0:
            if self.observes:
                self._set_state(SpecState.COLD, "cooldown over, probing")
            else:
                self._set_state(SpecState.ENABLED, "cooldown over, probing by drafting")

    # ---- the one transition point -------------------------------------------

    def _set_state(self, new: SpecState, reason: str) -> None:
        old = self._state
        if new is old:
            return
        log.info("speculation %s: %s -> %s (%s)", self.name, old.value, new.value, reason)
        self._state = new
        if new is SpecState.COLD:
            self._cold.clear()
        elif new is SpecState.ENABLED:
            self._verifies.clear()
        if self._on_transition is not None:
            self._on_transition(old, new, reason)
