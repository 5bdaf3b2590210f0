"""Which speculative strategy a model runs with, and the proposer seam.

Theory of operation: a *strategy* is a named recipe: its type (``ngram``,
``draft-model`` or ``none``), a draft model for the draft type, and a window policy.
Names come from the model package (``model-package.json`` beside the model) or are
built in: ``ngram`` (prompt lookup, ``auto`` mode), ``draft-model`` (needs a
``draft_model``) and ``none``. :func:`resolve_strategy` picks the name and then every
field from the first source that sets it, highest first:

    1. CLI flags                          (CliSpecOptions)
    2. [models.<name>.speculative]        in config.toml
    3. [defaults.speculative]             in config.toml
    4. the model package                  (its "default" strategy, then that
                                           strategy's own fields)
    5. built in                           ngram, auto (draft-model too), adaptive window 4 in [1, 16]

``--no-draft`` (``CliSpecOptions.no_draft``) refuses a draft model: a ``draft-model``
strategy chosen by any lower source becomes the built-in ``ngram``; asking for a draft
model on the same command line is a :class:`SpecConfigError`. ``mode = "off"`` or type
``none`` resolves to ``type="none", mode="off"``. An adaptive window's ``initial`` is
clamped into ``[min, max]`` (the bounds may come from different sources); a fixed
window uses ``initial`` and sets ``min = max = initial``.

Model-package input (``model-package.json`` beside a model; this is its one parser)::

    {"generation": {"speculative_decoding": {
        "default": "qwen-draft",
        "strategies": {
            "qwen-draft": {"type": "draft-model", "draft_model": "qwen2.5-0.5b-q4.gguf",
                           "window_policy": {"default": "adaptive", "initial_window": 4,
                                             "min_window": 1, "max_window": 16}},
            "lookup": {"type": "ngram"}}}}}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from meshnode.config import MODES, MeshnodeConfig, SpeculativeSettings, WindowSettings
from meshnode.errors import MeshnodeError
from meshnode.limits import MAX_VERIFY_WINDOW
from meshnode.spec.window import StageCompute, WindowPolicy, cap_for_route, drafts_at, route_window_rows

__all__ = [
    "BUILTIN_STRATEGIES",
    "CliSpecOptions",
    "DraftProposer",
    "PackageSpeculative",
    "PackageStrategy",
    "Proposer",
    "SpecConfig",
    "SpecConfigError",
    "WindowPolicy",
    "resolve_strategy",
]

StrategyType = Literal["ngram", "draft-model", "none"]
STRATEGY_TYPES: tuple[str, ...] = ("ngram", "draft-model", "none")
DEFAULT_WINDOW = WindowPolicy("adaptive", 4, 1, 16)


class SpecConfigError(MeshnodeError):
    """The speculative-decoding settings contradict each other or name nothing known."""


class Proposer(Protocol):
    """Where draft tokens come from (n-gram index, draft model)."""

    def reset(self, prompt: Sequence[int], *, sync: bool = True) -> None:
        """Start a new request whose context is ``prompt`` (``sync=False``: work on it
        may wait until the first :meth:`propose`)."""
        ...

    def propose(self, context_tail: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` drafts continuing the context (``[]``: nothing worth verifying).

        ``context_tail`` is the end of the context; proposers that track the whole
        context through :meth:`accept` may ignore it.
        """
        ...

    def accept(self, tokens: Sequence[int]) -> None:
        """Tokens the target emitted (accepted drafts, then the bonus), in order."""
        ...


class DraftProposer(Proposer, Protocol):
    """A proposer that is a model of its own (``spec/draft.py``): it decodes the tokens it
    was told about at its next call, which the serving loop may do early."""

    @property
    def lag(self) -> int:
        """Context tokens its next call would catch up on first."""
        ...

    def sync(self, max_rows: int | None = None) -> None:
        """Catch up on them now (on the first ``max_rows`` of them, when given)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class SpecConfig:
    strategy_name: str
    type: StrategyType
    mode: Literal["auto", "on", "off"]
    draft_model: str | None
    window: WindowPolicy
    source: str                 # where each setting came from, for logs and `status`

    @property
    def enabled(self) -> bool:
        return self.type != "none" and self.mode != "off"


@dataclass(frozen=True, slots=True)
class CliSpecOptions:
    """The speculative flags of ``meshnode serve`` (None: not given)."""

    strategy: str | None = None
    mode: str | None = None
    draft_model: str | None = None
    window_policy: str | None = None
    window_initial: int | None = None
    window_min: int | None = None
    window_max: int | None = None
    no_draft: bool = False

    def as_settings(self) -> SpeculativeSettings:
        return SpeculativeSettings(
            strategy=self.strategy,
            mode=self.mode,
            draft_model=self.draft_model,
            window=WindowSettings(
                self.window_policy, self.window_initial, self.window_min, self.window_max
            ),
        )


@dataclass(frozen=True, slots=True)
class PackageStrategy:
    name: str
    type: StrategyType
    draft_model: str | None = None
    window: WindowSettings = field(default_factory=WindowSettings)


@dataclass(frozen=True, slots=True)
class PackageSpeculative:
    """``generation.speculative_decoding`` of a model package."""

    default: str | None = None
    strategies: Mapping[str, PackageStrategy] = field(default_factory=dict)
    origin: str = "model package"

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], origin: str = "model package") -> "PackageSpeculative":
        """Parse a whole model-package document. Raises :class:`SpecConfigError`."""

        def err(key: str, msg: str) -> SpecConfigError:
            return SpecConfigError(f"{origin}: {key}: {msg}")

        def table(parent: Mapping[str, Any], key: str, dotted: str) -> Mapping[str, Any]:
            v = parent.get(key, {})
            if not isinstance(v, Mapping):
                raise err(dotted, f"expected an object, got {v!r}")
            return v

        gen = table(doc, "generation", "generation")
        sd = table(gen, "speculative_decoding", "generation.speculative_decoding")
        base = "generation.speculative_decoding"
        default = sd.get("default")
        if default is not None and (not isinstance(default, str) or not default):
            raise err(f"{base}.default", f"expected a strategy name, got {default!r}")
        strategies: dict[str, PackageStrategy] = {}
        for name, s in table(sd, "strategies", f"{base}.strategies").items():
            key = f"{base}.strategies.{name}"
            if not isinstance(s, Mapping):
                raise err(key, f"expected an object, got {s!r}")
            typ = s.get("type")
            if typ not in ("ngram", "draft-model", "none"):
                raise err(f"{key}.type", f"expected 'ngram', 'draft-model' or 'none', got {typ!r}")
            dm = s.get("draft_model")
            if dm is not None and (not isinstance(dm, str) or not dm):
                raise err(f"{key}.draft_model", f"expected a path or name, got {dm!r}")
            if typ == "draft-model" and dm is None:
                raise err(f"{key}.draft_model", "a draft-model strategy needs a draft_model")
            wp = table(s, "window_policy", f"{key}.window_policy")
            pol = wp.get("default")
            if pol is not None and pol not in ("adaptive", "fixed"):
                raise err(f"{key}.window_policy.default", f"expected 'adaptive' or 'fixed', got {pol!r}")
            sizes: dict[str, int | None] = {}
            for fld in ("initial_window", "min_window", "max_window"):
                v = wp.get(fld)
                if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                                      or not 1 <= v <= MAX_VERIFY_WINDOW):
                    raise err(f"{key}.window_policy.{fld}", f"expected an integer in [1, {MAX_VERIFY_WINDOW}], got {v!r}")
                sizes[fld] = v
            strategies[name] = PackageStrategy(
                name, typ, dm,
                WindowSettings(pol, sizes["initial_window"], sizes["min_window"], sizes["max_window"]),
            )
        if default is not None and default not in strategies:
            raise err(f"{base}.default", f"names no strategy of this package: {default!r}")
        return cls(default, strategies, origin)


BUILTIN_STRATEGIES: Mapping[str, PackageStrategy] = {
    "ngram": PackageStrategy("ngram", "ngram"),
    "draft-model": PackageStrategy("draft-model", "draft-model"),
    "none": PackageStrategy("none", "none"),
}
# A draft model runs in auto mode too: measured against plain steps on this route, a draft
# that slows decoding (a draft as costly as the target on a CPU: 0.5x) is only probed.
_DEFAULT_MODE = {"ngram": "auto", "draft-model": "auto", "none": "off"}


def resolve_strategy(
    model: str,
    *,
    cli: CliSpecOptions | None = None,
    config: MeshnodeConfig | None = None,
    package: PackageSpeculative | Mapping[str, Any] | None = None,
) -> SpecConfig:
    """The speculative settings for ``model`` (see the module doc for precedence).

    ``package`` is a :class:`PackageSpeculative` or the parsed ``model-package.json``.
    Raises :class:`SpecConfigError` for unknown strategy names, a draft-model strategy
    without a draft model, ``--no-draft`` against an explicit draft request, and
    window bounds that cannot hold.
    """
    cli = cli or CliSpecOptions()
    if package is not None and not isinstance(package, PackageSpeculative):
        package = PackageSpeculative.from_dict(package)
    cfg_where = f" ({config.path})" if config is not None and config.path else ""
    layers: list[tuple[str, SpeculativeSettings]] = [("CLI", cli.as_settings())]
    if config is not None:
        layers.append((f"[models.{model}.speculative]{cfg_where}", config.model_speculative(model)))
        layers.append((f"[defaults.speculative]{cfg_where}", config.defaults_speculative))
    for where, s in layers:
        if s.mode is not None and s.mode not in MODES:
            raise SpecConfigError(f"{where}: mode must be one of {', '.join(MODES)}, got {s.mode!r}")

    notes: list[str] = []

    # 1. the strategy name, then its definition
    name, name_from = None, "built-in"
    for where, s in layers:
        if s.strategy is not None:
            name, name_from = s.strategy, where
            break
    if name is None and package is not None and package.default is not None:
        name, name_from = package.default, package.origin
    if name is None:
        name = "ngram"
    if package is not None and name in package.strategies:
        definition, def_from = package.strategies[name], package.origin
    elif name in BUILTIN_STRATEGIES:
        definition, def_from = BUILTIN_STRATEGIES[name], "built-in"
    else:
        known = sorted({*BUILTIN_STRATEGIES, *(package.strategies if package else {})})
        raise SpecConfigError(
            f"{name_from}: unknown speculative strategy {name!r} for model {model!r}; "
            f"known: {', '.join(known)}"
        )
    notes.append(f"strategy {name!r} from {name_from}")

    # 2. --no-draft
    if cli.no_draft and definition.type == "draft-model":
        if cli.strategy is not None or cli.draft_model is not None:
            raise SpecConfigError("CLI: --no-draft contradicts the draft model asked for on the command line")
        notes.append(f"--no-draft replaced draft-model strategy {name!r} by built-in 'ngram'")
        name, definition, def_from = "ngram", BUILTIN_STRATEGIES["ngram"], "built-in"
        layers = [(w, SpeculativeSettings(mode=s.mode if w == "CLI" else None, window=s.window))
                  for w, s in layers]

    def pick(label: str, value_of: Callable[[SpeculativeSettings], Any], fallback: Any) -> Any:
        for where, st in layers:
            v = value_of(st)
            if v is not None:
                notes.append(f"{label} from {where}")
                return v
        return fallback

    typ: StrategyType = definition.type
    mode = pick("mode", lambda st: st.mode, _DEFAULT_MODE[typ])
    draft_model = None
    if typ == "draft-model":
        draft_model = pick("draft_model", lambda st: st.draft_model, definition.draft_model)
        if draft_model is None:
            raise SpecConfigError(
                f"{name_from}: strategy {name!r} is a draft-model strategy but no draft_model is set "
                "(use --draft-model, draft_model in config.toml, or the model package)"
            )

    if typ == "none" or mode == "off":
        return SpecConfig(name, "none", "off", None, DEFAULT_WINDOW, "; ".join(notes))

    dw = definition.window
    if def_from != "built-in" and dw != WindowSettings():
        notes.append(f"window defaults from strategy {name!r} ({def_from})")
    kind = pick("window.policy", lambda st: st.window.policy, dw.policy or DEFAULT_WINDOW.kind)
    initial = pick("window.initial", lambda st: st.window.initial, dw.initial or DEFAULT_WINDOW.initial)
    lo = pick("window.min", lambda st: st.window.min, dw.min or DEFAULT_WINDOW.min)
    hi = pick("window.max", lambda st: st.window.max, dw.max or DEFAULT_WINDOW.max)
    for label, v in (("initial", initial), ("min", lo), ("max", hi)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_VERIFY_WINDOW:
            raise SpecConfigError(f"window.{label} must be an integer in [1, {MAX_VERIFY_WINDOW}], got {v!r}")
    if kind == "fixed":
        window = WindowPolicy("fixed", initial, initial, initial)
    elif kind == "adaptive":
        if lo > hi:
            raise SpecConfigError(f"window.min ({lo}) is larger than window.max ({hi}) for model {model!r}; "
                                  f"settings: {'; '.join(notes)}")
        window = WindowPolicy("adaptive", min(max(initial, lo), hi), lo, hi)
    else:
        raise SpecConfigError(f"window policy must be 'adaptive' or 'fixed', got {kind!r}")
    return SpecConfig(name, typ, mode, draft_model, window, "; ".join(notes))


def exact_for_route(spec: SpecConfig | None, stages: Sequence[StageCompute]) -> SpecConfig | None:
    """``spec`` with its verify windows capped to what every stage of the route computes
    exactly: a GPU stage takes windows of 4 rows at most (8 when its node pads steps to
    5-8 rows; spec/window.py), so greedy text with speculation equals text without it on
    any mesh without the user sizing windows by hand. ``spec`` itself when nothing changes."""
    if spec is None or not spec.enabled:
        return spec
    window = cap_for_route(spec.window, stages)
    return spec if window == spec.window else dataclasses.replace(spec, window=window)


class RouteWindows:
    """Speculation's settings as configured (``asked``) and as the current route computes
    them exactly (``config``): :meth:`follow` re-caps them whenever the route changes (a
    re-plan onto a GPU stage narrows the windows, one off it widens them again)."""

    def __init__(self, asked: SpecConfig | None) -> None:
        self.asked = asked
        self.config = asked
        self._stages: tuple[StageCompute, ...] = ()
        self._rows = MAX_VERIFY_WINDOW   # the route's widest exact window (route_window_rows)

    def follow(self, stages: Sequence[StageCompute]) -> bool:
        """The route's stages are now ``stages``; True when the window bounds changed."""
        self._stages = tuple(stages)
        self._rows = route_window_rows(self._stages)
        capped = exact_for_route(self.asked, stages)
        if capped is None or not capped.enabled or self.config is None or capped.window == self.config.window:
            return False
        self.config = capped
        return True

    def drafts_at(self, pos: int) -> int:
        """The most drafts a window at position ``pos`` may carry on this route and stay
        exact (spec/window.py, ``drafts_at``: a GPU stage's KV buckets)."""
        return drafts_at(pos, self._stages)

    def exact_rows_at(self, pos: int) -> int:
        """The widest step starting at position ``pos`` whose every row this route
        computes as its one-row step would, whatever speculation is configured (a
        failover's replay of generated tokens, serve/failover.py): every stage's exact
        window width, within the KV bucket a GPU stage's one-row steps fill."""
        return max(1, min(self._rows, 1 + self.drafts_at(pos)))
