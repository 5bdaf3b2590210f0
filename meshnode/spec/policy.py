"""When to speculate (auto policy) and how far (window policy, cost model).

Theory of operation.

*Auto policy* (n-gram ``auto`` mode), one state machine per model on stage 0::

    COLD --prompt affinity >= enable / repeated would-be hits--> ENABLED
    ENABLED --acceptance too low to pay, after min_windows--> COOLING_DOWN
    COOLING_DOWN --cooldown tokens generated--> COLD        (probe again)
    ENABLED --new prompt without affinity--> COLD
    OFF: mode "off" (never leaves); mode "on" pins ENABLED.

A proposer that cannot be watched for free (a draft model) has no COLD phase
(``observes=False``): auto starts ENABLED and a cooldown ends in ENABLED (a probe).

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

*Window*: with per-token acceptance ``a``, a window of ``k`` drafts yields
``E(k) = (1 - a^(k+1)) / (1 - a)`` tokens (accepted prefix + bonus) and costs one
pipeline step of ``k + 1`` rows. :class:`CostModel` learns ``seconds(k)`` for this
route (EWMA per window, interpolated between measured windows, seeded with a linear
prior: the hop latency plus a plain step that grows by ``row_slope`` steps per extra
row; DESIGN.md section 3 measured ~0.45 on CPU). :class:`AdaptiveWindow` grows on full
acceptance, shrinks on early rejection, and caps the window at the ``k`` maximising
``E(k) / seconds(k)``. Windows never exceed :data:`MAX_WINDOW` (batch invariance).

Pure logic: no clock (callers pass measured seconds), no I/O.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from meshnode.config import MAX_WINDOW
from meshnode.state import SpecState

__all__ = [
    "AdaptiveWindow",
    "AutoPolicy",
    "AutoPolicyParams",
    "CostModel",
    "FixedWindow",
    "MAX_WINDOW",
    "WindowController",
    "WindowPolicy",
    "expected_tokens",
    "make_window",
    "prompt_affinity",
]

log = logging.getLogger(__name__)

Mode = Literal["auto", "on", "off"]


# ---- window policy (configuration) --------------------------------------------


@dataclass(frozen=True, slots=True)
class WindowPolicy:
    """How many drafts per verify: ``kind`` adaptive (within [min, max]) or fixed (initial)."""

    kind: Literal["adaptive", "fixed"] = "adaptive"
    initial: int = 4
    min: int = 1
    max: int = 16

    def __post_init__(self) -> None:
        if self.kind not in ("adaptive", "fixed"):
            raise ValueError(f"window policy must be 'adaptive' or 'fixed', got {self.kind!r}")
        for name in ("initial", "min", "max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_WINDOW:
                raise ValueError(f"window {name} must be an integer in [1, {MAX_WINDOW}], got {v!r}")
        if not self.min <= self.initial <= self.max:
            raise ValueError(
                f"window needs min <= initial <= max, got {self.min} <= {self.initial} <= {self.max}"
            )


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


class AutoPolicy:
    """Decides, step by step, whether stage 0 drafts (ENABLED) or decodes plainly.

    Caller protocol, per request: :meth:`on_prompt`; then each step, if
    :attr:`should_draft` verify a window and :meth:`record_verify`; else, if
    :attr:`should_observe`, :meth:`record_cold` with the proposer's would-hit answer;
    always :meth:`on_generated` with the number of tokens emitted.

    ``observes=False`` is for proposers that cannot be watched for free (a draft model
    costs a forward pass per guess): there is no COLD phase. Auto mode starts ENABLED,
    ignores prompt shape, and probes again *by drafting* when a cooldown ends; the
    judgement (floor, realized gain, cooldowns) is the same.
    """

    def __init__(
        self,
        mode: Mode = "auto",
        params: AutoPolicyParams | None = None,
        *,
        name: str = "ngram",
        on_transition: Callable[[SpecState, SpecState, str], None] | None = None,
        cost: "CostModel | None" = None,
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

    def on_prompt(self, prompt_tokens: Sequence[int]) -> float:
        """A new request starts; returns its prompt affinity score.

        High affinity enables drafting at once (also out of COOLING_DOWN: a new prompt
        of the right shape is new evidence); otherwise an ENABLED policy goes back to
        COLD to observe the new request before paying for verifies.
        """
        p = self.params
        score = prompt_affinity(prompt_tokens, p.affinity_n)
        self.last_affinity = score
        if self.mode != "auto" or not self.observes:
            return score
        self._cold.clear()
        if len(prompt_tokens) >= p.affinity_min_tokens and score >= p.affinity_enable:
            if self._state is not SpecState.ENABLED:
                self._set_state(SpecState.ENABLED, f"prompt affinity {score:.2f}")
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


# ---- cost model ---------------------------------------------------------------


def expected_tokens(k: int, a: float) -> float:
    """Tokens a window of ``k`` drafts yields at per-token acceptance ``a`` (incl. bonus)."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    if a <= 0.0:
        return 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class CostModel:
    """Seconds one pipeline step takes on this route, as a function of the window.

    ``window`` counts drafts: 0 is a plain decode step (one row), ``k`` a verify of
    ``k + 1`` rows. Prior: ``hop_s + step_s * (1 + row_slope * k) + draft_s_per_token * k``.
    :meth:`observe` feeds measured step times (whole round trip, hops included).
    """

    def __init__(
        self,
        *,
        step_s: float = 0.0082,
        hop_s: float = 0.0,
        row_slope: float = 0.45,
        draft_s_per_token: float = 0.0,
        alpha: float = 0.25,
    ) -> None:
        if step_s <= 0 or hop_s < 0 or row_slope < 0 or draft_s_per_token < 0:
            raise ValueError("cost prior needs step_s > 0 and non-negative hop/slope/draft costs")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.step_s = step_s
        self.hop_s = hop_s
        self.row_slope = row_slope
        self.draft_s_per_token = draft_s_per_token
        self.alpha = alpha
        self._ewma: dict[int, float] = {}

    def prior(self, window: int) -> float:
        k = max(0, window)
        return self.hop_s + self.step_s * (1.0 + self.row_slope * k) + self.draft_s_per_token * k

    def observe(self, window: int, seconds: float) -> None:
        """Record one measured step of ``window`` drafts (0 = plain decode)."""
        if not 0 <= window <= MAX_WINDOW:
            raise ValueError(f"window must be in [0, {MAX_WINDOW}], got {window}")
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        old = self._ewma.get(window)
        self._ewma[window] = seconds if old is None else old + self.alpha * (seconds - old)

    @property
    def plain_s(self) -> float | None:
        """Measured seconds of a plain step on this route (EWMA; None before any)."""
        return self._ewma.get(0)

    @property
    def measured(self) -> bool:
        """True once plain steps and at least one verify window were measured here."""
        return 0 in self._ewma and len(self._ewma) >= 2

    @property
    def observed(self) -> dict[int, float]:
        """Current EWMA per measured window (a copy)."""
        return dict(self._ewma)

    def _slope(self) -> float:
        """Least-squares seconds per extra draft over measured windows (>= 0)."""
        xs = list(self._ewma)
        n = len(xs)
        mx = sum(xs) / n
        my = sum(self._ewma.values()) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        sxy = sum((x - mx) * (self._ewma[x] - my) for x in xs)
        return max(0.0, sxy / sxx)

    def seconds(self, window: int) -> float:
        """Estimated seconds for a step of ``window`` drafts."""
        k = max(0, window)
        obs = self._ewma
        if k in obs:
            return obs[k]
        if not obs:
            return self.prior(k)
        lower = max((x for x in obs if x < k), default=None)
        upper = min((x for x in obs if x > k), default=None)
        if lower is not None and upper is not None:
            f = (k - lower) / (upper - lower)
            return obs[lower] + f * (obs[upper] - obs[lower])
        near = lower if lower is not None else upper
        if near is None:  # unreachable: obs is non-empty
            return self.prior(k)
        if len(obs) >= 2:
            est = obs[near] + self._slope() * (k - near)
        else:  # one measurement: shift the prior's shape through it
            est = obs[near] + self.prior(k) - self.prior(near)
        return max(est, 1e-9)

    def relative(self, window: int) -> float:
        """Step cost in units of a plain decode step."""
        return self.seconds(window) / self.seconds(0)

    def tokens_per_second(self, window: int, acceptance: float) -> float:
        return expected_tokens(window, acceptance) / self.seconds(window)

    def speedup(self, window: int, acceptance: float) -> float:
        """Expected throughput of ``window`` relative to plain decoding (> 1: it pays)."""
        return self.tokens_per_second(window, acceptance) * self.seconds(0)

    def best_window(self, acceptance: float, lo: int = 1, hi: int = MAX_WINDOW) -> int:
        """The ``k`` in ``[lo, hi]`` maximising expected tokens per second (smallest on ties)."""
        lo = max(0, lo)
        hi = min(MAX_WINDOW, max(lo, hi))
        best_k, best = lo, -1.0
        for k in range(lo, hi + 1):
            v = self.tokens_per_second(k, acceptance)
            if v > best * (1 + 1e-9):
                best_k, best = k, v
        return best_k


# ---- window controllers -------------------------------------------------------


class WindowController(Protocol):
    @property
    def size(self) -> int: ...

    @property
    def acceptance(self) -> float: ...

    def next_window(self) -> int:
        """Drafts to ask for in the next verify step (>= 1)."""
        ...

    def update(self, proposed: int, accepted: int) -> None:
        """One verify came back: ``accepted`` of ``proposed`` drafts kept."""
        ...


class _AcceptanceEstimate:
    """Discounted per-token acceptance with a Beta-like prior."""

    __slots__ = ("hits", "trials", "prior", "weight", "decay")

    def __init__(self, prior: float, weight: float, decay: float) -> None:
        self.hits = 0.0
        self.trials = 0.0
        self.prior = prior
        self.weight = weight
        self.decay = decay

    def add(self, hits: float, trials: float) -> None:
        self.hits = self.decay * self.hits + hits
        self.trials = self.decay * self.trials + trials

    @property
    def value(self) -> float:
        return (self.hits + self.prior * self.weight) / (self.trials + self.weight)


def _check_update(proposed: int, accepted: int) -> None:
    if proposed < 0 or not 0 <= accepted <= proposed:
        raise ValueError(f"need 0 <= accepted <= proposed, got {accepted} of {proposed}")


class AdaptiveWindow:
    """Window that grows on full acceptance, shrinks on early rejection, capped by cost.

    Full acceptance grows the window by half (at least 1); a rejection within the
    first half of the window shrinks it to ``max(accepted + 1, size // 2)``. With a
    :class:`CostModel`, :meth:`next_window` never exceeds the window that maximises
    expected tokens per second at the current acceptance estimate.
    """

    def __init__(
        self,
        initial: int = 4,
        min_window: int = 1,
        max_window: int = 16,
        *,
        cost: CostModel | None = None,
        prior_acceptance: float = 0.6,
        prior_weight: float = 2.0,
        decay: float = 0.9,
    ) -> None:
        WindowPolicy("adaptive", initial, min_window, max_window)  # validates
        self.min = min_window
        self.max = max_window
        self._size = initial
        self.cost = cost
        self._est = _AcceptanceEstimate(prior_acceptance, prior_weight, decay)

    @property
    def size(self) -> int:
        """The grow/shrink window before the cost cap."""
        return self._size

    @property
    def acceptance(self) -> float:
        """Running per-token acceptance estimate."""
        return self._est.value

    @property
    def cap(self) -> int:
        """Cost-optimal window at the current acceptance (``max`` without a cost model)."""
        if self.cost is None:
            return self.max
        return self.cost.best_window(self.acceptance, self.min, self.max)

    def next_window(self) -> int:
        return max(self.min, min(self._size, self.cap))

    def seed_acceptance(self, hits: int, trials: int) -> None:
        """Fold in would-be hits counted while COLD (free evidence)."""
        if trials > 0:
            self._est.add(hits, trials)

    def update(self, proposed: int, accepted: int) -> None:
        _check_update(proposed, accepted)
        if proposed == 0:
            return
        self._est.add(accepted, accepted + (1 if accepted < proposed else 0))
        if accepted == proposed:
            self._size = min(self.max, self._size + max(1, self._size // 2))
        elif accepted < (proposed + 1) // 2:
            self._size = max(self.min, accepted + 1, self._size // 2)


class FixedWindow:
    """Always the same window (still tracks acceptance for telemetry)."""

    def __init__(self, size: int, *, prior_acceptance: float = 0.6, decay: float = 0.9) -> None:
        WindowPolicy("fixed", size, size, size)  # validates
        self._size = size
        self._est = _AcceptanceEstimate(prior_acceptance, 2.0, decay)

    @property
    def size(self) -> int:
        return self._size

    @property
    def acceptance(self) -> float:
        return self._est.value

    def next_window(self) -> int:
        return self._size

    def update(self, proposed: int, accepted: int) -> None:
        _check_update(proposed, accepted)
        if proposed:
            self._est.add(accepted, accepted + (1 if accepted < proposed else 0))


def make_window(policy: WindowPolicy, cost: CostModel | None = None) -> AdaptiveWindow | FixedWindow:
    """The controller for ``policy`` (fixed uses ``policy.initial``)."""
    if policy.kind == "fixed":
        return FixedWindow(policy.initial)
    return AdaptiveWindow(policy.initial, policy.min, policy.max, cost=cost)
