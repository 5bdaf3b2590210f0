"""What a pipeline step costs on this route, and what a window of drafts yields.

Theory of operation. With per-token acceptance ``a``, a window of ``k`` drafts yields
``E(k) = (1 - a^(k+1)) / (1 - a)`` tokens (accepted prefix + bonus,
:func:`expected_tokens`) and costs one pipeline step of ``k + 1`` rows.
:class:`CostModel` learns ``seconds(k)`` for this route: an EWMA per window, interpolated
between measured windows, extended above the widest by the slope among verify windows (a
plain step is not one of them: :meth:`CostModel.seconds`), seeded with a linear prior (the hop latency plus a plain step
that grows by ``row_slope`` steps per extra row; ~0.45 was measured on CPU). A step
measured while something else took the machine (a build on a laptop's cores) can take a
hundred times its usual time: one sample moves an estimate by at most ``OUTLIER`` times
what was expected, and no window is estimated dearer than a wider one measured, so one
slow step cannot keep a window size out of use for the rest of the route. Its
``best_window`` (the ``k`` maximising ``E(k) / seconds(k)``) caps the adaptive window
(:mod:`meshnode.spec.window`), and its ``speedup`` is the auto policy's fallback gate
(:mod:`meshnode.spec.policy`) for windows reported without their time.

Pure logic: no clock (callers pass measured seconds), no I/O.
"""

from __future__ import annotations

from meshnode.limits import MAX_VERIFY_WINDOW

__all__ = ["CostModel", "expected_tokens"]

# How far above what was expected one sample may count (a sustained change still gets
# there: each step may move the estimate up by (OUTLIER - 1) * alpha of itself).
OUTLIER = 4.0


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
        if not 0 <= window <= MAX_VERIFY_WINDOW:
            raise ValueError(f"window must be in [0, {MAX_VERIFY_WINDOW}], got {window}")
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        old = self._ewma.get(window)
        if self._ewma:   # (the first measurement has nothing to be weighed against)
            seconds = min(seconds, OUTLIER * (old if old is not None else self.seconds(window)))
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

    def _slope(self, xs: list[int]) -> float:
        """Least-squares seconds per extra draft over the measured windows ``xs`` (>= 0)."""
        n = len(xs)
        mx = sum(xs) / n
        my = sum(self._ewma[x] for x in xs) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        sxy = sum((x - mx) * (self._ewma[x] - my) for x in xs)
        return max(0.0, sxy / sxx)

    def seconds(self, window: int) -> float:
        """Estimated seconds for a step of ``window`` drafts: at most what any wider
        window measured (more rows never cost less)."""
        k = max(0, window)
        wider = min((v for x, v in self._ewma.items() if x > k), default=float("inf"))
        return min(self._estimate(k), wider)

    def _estimate(self, k: int) -> float:
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
        # Above the widest measured window, extend the slope among verify windows only: a
        # window costs more than its rows over a plain step (the draft model's catch-up
        # call, the verify's bookkeeping), so the slope from a plain step to a one-draft
        # window overstates each further draft, and a window capped by it may never
        # grow to be measured. With one window size measured, the prior's per-draft
        # cost: optimistic where rows are dear (a CPU), so the next size gets measured
        # and corrects it.
        xs = [x for x in obs if x >= 1] if lower is not None else list(obs)
        if len(xs) >= 2:
            est = obs[near] + self._slope(xs) * (k - near)
        else:  # one measurement to go by: shift the prior's shape through it
            est = obs[near] + self.prior(k) - self.prior(near)
            if 1 <= near < k and 0 in obs:
                # ...at no more per draft than this route's drafts have cost over a plain
                # step: the prior's per-draft cost is a CPU's, and where a step is a few
                # milliseconds (a GPU) it made a second draft look dearer than the first
                # window's gain, so the window stayed at one draft, never measured wider
                per_draft = max(0.0, (obs[near] - obs[0]) / near)
                est = min(est, obs[near] + per_draft * (k - near))
        return max(est, 1e-9)

    @property
    def window_steps(self) -> float | None:
        """What a 1-draft window costs in plain steps here, once measured (None before)."""
        return self.relative(1) if self.measured else None

    def relative(self, window: int) -> float:
        """Step cost in units of a plain decode step."""
        return self.seconds(window) / self.seconds(0)

    def tokens_per_second(self, window: int, acceptance: float) -> float:
        return expected_tokens(window, acceptance) / self.seconds(window)

    def speedup(self, window: int, acceptance: float) -> float:
        """Expected throughput of ``window`` relative to plain decoding (> 1: it pays)."""
        return self.tokens_per_second(window, acceptance) * self.seconds(0)

    def best_window(self, acceptance: float, lo: int = 1, hi: int = MAX_VERIFY_WINDOW) -> int:
        """The ``k`` in ``[lo, hi]`` maximising expected tokens per second (smallest on ties)."""
        lo = max(0, lo)
        hi = min(MAX_VERIFY_WINDOW, max(lo, hi))
        best_k, best = lo, -1.0
        for k in range(lo, hi + 1):
            v = self.tokens_per_second(k, acceptance)
            if v > best * (1 + 1e-9):
                best_k, best = k, v
        return best_k
