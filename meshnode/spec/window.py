"""How many drafts per verify step: the window policy and its controllers.

Theory of operation. :class:`WindowPolicy` is the configuration (adaptive within
``[min, max]``, or fixed); :func:`make_window` turns it into a controller that the
serving loop asks before each verify (``next_window()``) and tells the outcome
(``update(proposed, accepted)``).

:class:`AdaptiveWindow` grows on full acceptance, shrinks on early rejection, and caps
the window at the ``k`` maximising ``E(k) / seconds(k)`` under a
:class:`~meshnode.spec.cost_model.CostModel` (at its running per-token acceptance
estimate). :class:`FixedWindow` always asks for the same window and only tracks
acceptance for telemetry. Windows never exceed :data:`meshnode.limits.MAX_VERIFY_WINDOW`
(batch invariance).

Pure logic: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

from meshnode.limits import GPU_PAD_ROWS, MAX_VERIFY_WINDOW, gpu_bucket_drafts, gpu_exact_window_rows
from meshnode.spec.cost_model import CostModel

__all__ = [
    "AdaptiveWindow",
    "FixedWindow",
    "WindowController",
    "WindowPolicy",
    "drafts_at",
    "make_window",
    "route_window_rows",
]


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
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_VERIFY_WINDOW:
                raise ValueError(f"window {name} must be an integer in [1, {MAX_VERIFY_WINDOW}], got {v!r}")
        if not self.min <= self.initial <= self.max:
            raise ValueError(
                f"window needs min <= initial <= max, got {self.min} <= {self.initial} <= {self.max}"
            )

    def at_most(self, drafts: int) -> WindowPolicy:
        """This policy with windows of at most ``drafts`` drafts (itself when already so)."""
        most = max(1, drafts)
        if self.max <= most:
            return self
        return WindowPolicy(self.kind, min(self.initial, most), min(self.min, most), most)


# The widest verify window (the last token and its drafts) that reproduces one-row steps
# bit for bit, per compute backend. On CPU every width up to MAX_VERIFY_WINDOW is exact
# (docs/engine.md, "Batch invariance"). CUDA picks its matmul kernels by row count: a GPU
# stage pads every call of fewer rows to its node's pad width (limits.gpu_pad_rows, flash
# attention off; each node advertises its own in its capabilities), which makes windows of
# up to 4 rows (pad 2-4) or 8 rows (pad 5-8) equal one-row steps; wider ones do not on a
# quantized model (docs/engine.md, "GPU"). Other GPU backends are not measured; they pad
# the same way and get the same bound.


class StageCompute(Protocol):
    """What one stage of a route computes on (``state.StageInfo`` carries it): its
    ``backend`` ("" = not known yet) and its node's GPU pad width (0 = not told: the
    default width)."""

    @property
    def backend(self) -> str: ...

    @property
    def gpu_pad_rows(self) -> int: ...


def exact_window_rows(stage: StageCompute) -> int:
    """The widest exact verify window on ``stage`` (a stage of unknown backend: no bound)."""
    if stage.backend in ("", "cpu"):
        return MAX_VERIFY_WINDOW
    return gpu_exact_window_rows(stage.gpu_pad_rows or GPU_PAD_ROWS)


def chunk_invariant(stages: Iterable[StageCompute]) -> bool:
    """Whether every stage computes a prompt row the same whatever chunk it is in (CPU
    stages; on a GPU the kernels, and so the rounding, follow the call's row count and
    position), so KV computed by an earlier prompt's chunks can stand in for this one's
    (serve/prefix_cache.py, ``align``)."""
    return all(s.backend in ("", "cpu") for s in stages)


def route_window_rows(stages: Iterable[StageCompute]) -> int:
    """The widest exact verify window on every stage of a route (its narrowest stage's)."""
    return min((exact_window_rows(s) for s in stages), default=MAX_VERIFY_WINDOW)


def drafts_at(pos: int, stages: Iterable[StageCompute]) -> int:
    """The most drafts a window at position ``pos`` may carry on a route of ``stages`` and
    stay exact: unbounded (MAX_VERIFY_WINDOW) on CPU stages; on a GPU stage, no further
    than the KV bucket its one-row steps fill (limits.gpu_bucket_drafts)."""
    return min((gpu_bucket_drafts(pos, s.gpu_pad_rows or GPU_PAD_ROWS)
                for s in stages if s.backend not in ("", "cpu")), default=MAX_VERIFY_WINDOW)


def cap_for_route(policy: WindowPolicy, stages: Iterable[StageCompute]) -> WindowPolicy:
    """``policy`` with at most as many drafts as every stage of the route computes exactly
    (a window of ``rows`` rows carries ``rows - 1`` drafts): one GPU stage caps the route,
    at its own node's pad width."""
    return policy.at_most(route_window_rows(stages) - 1)


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
