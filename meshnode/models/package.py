"""``model-package.json``: how a model wants to be served, placed beside its GGUF.

Schema (docs/models.md has the long form)::

    {
      "name": "smollm2-135m",
      "generation": {
        "speculative_decoding": {
          "default": "draft",
          "strategies": {
            "draft": {"type": "draft-model", "draft_model": "tiny.gguf",
                      "window_policy": {"default": "adaptive", "initial_window": 4,
                                        "min_window": 1, "max_window": 16}},
            "lookup": {"type": "ngram"}
          }
        }
      }
    }

Only ``name`` is required. Parsing is strict: an unknown key, a wrong type or an
inconsistent value raises :class:`ModelPackageError` whose message names the field by its
dotted path (``generation.speculative_decoding.strategies.draft.window_policy.max_window``).
The result is a tree of frozen dataclasses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from meshnode.models.errors import ModelPackageError

PACKAGE_FILENAME = "model-package.json"
STRATEGY_TYPES = ("draft-model", "ngram")
WINDOW_POLICIES = ("adaptive", "fixed")
# Verify batches stay <= 32 tokens: llama.cpp CPU logits are batch-invariant only up to
# there (DESIGN.md section 3).
MAX_WINDOW_LIMIT = 32
DEFAULT_WINDOW = {"default": "adaptive", "initial_window": 4, "min_window": 1, "max_window": 16}

__all__ = [
    "PACKAGE_FILENAME",
    "ModelPackage",
    "SpeculativeDecoding",
    "SpeculativeStrategy",
    "WindowPolicy",
    "find_model_package",
    "load_model_package",
    "parse_model_package",
]


@dataclass(frozen=True, slots=True)
class WindowPolicy:
    default: Literal["adaptive", "fixed"]
    initial_window: int
    min_window: int
    max_window: int


@dataclass(frozen=True, slots=True)
class SpeculativeStrategy:
    name: str
    type: Literal["draft-model", "ngram"]
    draft_model: str | None       # as written: a path (relative to the package) or a store name
    window_policy: WindowPolicy


@dataclass(frozen=True, slots=True)
class SpeculativeDecoding:
    default: str
    strategies: tuple[SpeculativeStrategy, ...]

    def strategy(self, name: str | None = None) -> SpeculativeStrategy:
        """The strategy called ``name`` (default: the package's default). KeyError if absent."""
        wanted = name or self.default
        for s in self.strategies:
            if s.name == wanted:
                return s
        raise KeyError(wanted)


@dataclass(frozen=True, slots=True)
class ModelPackage:
    name: str
    speculative_decoding: SpeculativeDecoding | None
    source: Path | None = None    # the json file it came from

    def draft_model_spec(self, strategy: str | None = None) -> str | None:
        """What to give :func:`meshnode.models.store.resolve_model` for a strategy's draft.

        A relative path that exists beside the package is made absolute; anything else is
        returned as written (a store name or an absolute path). None for ngram strategies
        or when the package has no speculative decoding section.
        """
        if self.speculative_decoding is None:
            return None
        s = self.speculative_decoding.strategy(strategy)
        if s.draft_model is None:
            return None
        if self.source is not None:
            candidate = (self.source.parent / s.draft_model)
            if not Path(s.draft_model).is_absolute() and candidate.exists():
                return str(candidate.resolve())
        return s.draft_model


def load_model_package(path: Path | str) -> ModelPackage:
    """Parse the ``model-package.json`` at ``path``; ModelPackageError names what is wrong."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelPackageError(f"{p}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelPackageError(f"{p}: cannot read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelPackageError(f"{p}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    return parse_model_package(data, source=p)


def find_model_package(model_path: Path | str) -> ModelPackage | None:
    """The package beside a GGUF (or in a model folder), or None when there is none."""
    p = Path(model_path)
    folder = p if p.is_dir() else p.parent
    candidate = folder / PACKAGE_FILENAME
    return load_model_package(candidate) if candidate.is_file() else None


def parse_model_package(data: Any, *, source: Path | None = None) -> ModelPackage:
    """Validate decoded JSON ``data`` and build a :class:`ModelPackage`."""
    where = f"{source}: " if source is not None else f"{PACKAGE_FILENAME}: "
    try:
        return _package(data, source)
    except _FieldError as exc:
        raise ModelPackageError(f"{where}{exc.path}: {exc.problem}") from None


class _FieldError(Exception):
    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path or "(top level)"
        self.problem = problem


def _obj(value: Any, path: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise _FieldError(path, f"must be an object, got {_kind(value)}")
    for key in value:
        if key not in allowed:
            raise _FieldError(_join(path, key), f"unknown field (allowed: {', '.join(allowed)})")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _FieldError(path, f"must be a non-empty string, got {_kind(value)}")
    return value


def _int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _FieldError(path, f"must be an integer, got {_kind(value)}")
    return value


def _choice(value: Any, path: str, choices: tuple[str, ...]) -> Any:
    if value not in choices:
        raise _FieldError(path, f"must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "an array", str: f"string {value!r}", bool: f"{value}".lower()}.get(
        type(value), f"{type(value).__name__} {value!r}"
    )


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _package(data: Any, source: Path | None) -> ModelPackage:
    top = _obj(data, "", ("name", "generation"))
    if "name" not in top:
        raise _FieldError("name", "is required")
    name = _str(top["name"], "name")
    spec = None
    if "generation" in top:
        gen = _obj(top["generation"], "generation", ("speculative_decoding",))
        if "speculative_decoding" in gen:
            spec = _speculative(gen["speculative_decoding"], "generation.speculative_decoding")
    return ModelPackage(name=name, speculative_decoding=spec, source=source)


def _speculative(value: Any, path: str) -> SpeculativeDecoding:
    obj = _obj(value, path, ("default", "strategies"))
    for required in ("default", "strategies"):
        if required not in obj:
            raise _FieldError(_join(path, required), "is required")
    spath = _join(path, "strategies")
    strategies_obj = obj["strategies"]
    if not isinstance(strategies_obj, dict) or not strategies_obj:
        raise _FieldError(spath, f"must be a non-empty object, got {_kind(strategies_obj)}")
    strategies = tuple(
        _strategy(name, body, _join(spath, name)) for name, body in strategies_obj.items()
    )
    default = _str(obj["default"], _join(path, "default"))
    if default not in strategies_obj:
        raise _FieldError(
            _join(path, "default"),
            f"names no strategy: {default!r} (strategies: {', '.join(strategies_obj)})",
        )
    return SpeculativeDecoding(default=default, strategies=strategies)


def _strategy(name: str, value: Any, path: str) -> SpeculativeStrategy:
    obj = _obj(value, path, ("type", "draft_model", "window_policy"))
    if "type" not in obj:
        raise _FieldError(_join(path, "type"), "is required")
    kind = _choice(obj["type"], _join(path, "type"), STRATEGY_TYPES)
    draft = None
    if kind == "draft-model":
        if "draft_model" not in obj:
            raise _FieldError(_join(path, "draft_model"), "is required for type 'draft-model'")
        draft = _str(obj["draft_model"], _join(path, "draft_model"))
    elif "draft_model" in obj:
        raise _FieldError(_join(path, "draft_model"), f"only applies to type 'draft-model', not {kind!r}")
    window = _window(obj.get("window_policy", {}), _join(path, "window_policy"))
    return SpeculativeStrategy(name=name, type=kind, draft_model=draft, window_policy=window)


def _window(value: Any, path: str) -> WindowPolicy:
    obj = _obj(value, path, tuple(DEFAULT_WINDOW))
    merged = {**DEFAULT_WINDOW, **obj}
    default = _choice(merged["default"], _join(path, "default"), WINDOW_POLICIES)
    ints = {k: _int(merged[k], _join(path, k)) for k in ("initial_window", "min_window", "max_window")}
    if ints["min_window"] < 1:
        raise _FieldError(_join(path, "min_window"), f"must be >= 1, got {ints['min_window']}")
    if ints["max_window"] > MAX_WINDOW_LIMIT:
        raise _FieldError(
            _join(path, "max_window"),
            f"must be <= {MAX_WINDOW_LIMIT} (larger verify batches are not batch-invariant), "
            f"got {ints['max_window']}",
        )
    if ints["min_window"] > ints["max_window"]:
        raise _FieldError(
            _join(path, "min_window"),
            f"must be <= max_window ({ints['min_window']} > {ints['max_window']})",
        )
    if not ints["min_window"] <= ints["initial_window"] <= ints["max_window"]:
        raise _FieldError(
            _join(path, "initial_window"),
            f"must be between min_window and max_window ({ints['min_window']}..{ints['max_window']}), "
            f"got {ints['initial_window']}",
        )
    return WindowPolicy(default=default, **ints)
