"""The node's TOML configuration file (``NodePaths.config_file``).

Theory of operation: the file is optional and every setting in it is optional. It is
read once with :mod:`tomllib`, validated into frozen dataclasses, and handed to whoever
needs it (no module globals). A value of the wrong type or out of range is a
:class:`ConfigError` naming the file, the dotted key and what was expected; an unknown
key is only a warning (collected in :attr:`MeshnodeConfig.warnings` and logged) so an
older node can read a newer file. Unset values stay ``None``: the caller applies its
own defaults, and CLI flags override the file (see ``meshnode/spec/strategy.py`` for
the speculative-decoding precedence). docs/config.md lists every option.

    [node]
    name = "laptop"
    http_port = 8642
    max_memory = "6GB"
    shutdown_grace = 3.0                # seconds requests in flight get at SIGINT/SIGTERM
    prefix_cache = 3                    # finished sessions kept for prefix reuse (0: off)
    busy_poll = false                   # spin, not sleep, while tokens flow (net/busypoll.py)

    [http]                              # the OpenAI endpoint (docs/api.md, Security)
    api_key = "..."                     # required when bound off loopback
    allowed_hosts = ["laptop.local"]
    cors_origins = ["http://localhost:3000"]
    max_body = "4MiB"
    max_queue = 16
    keep_responses = "disk"             # or "memory": kept Responses survive a restart?

    [defaults.speculative]              # every model
    strategy = "ngram"
    mode = "auto"
    window = { policy = "adaptive", initial = 4, min = 1, max = 16 }

    [models."qwen2.5-7b".speculative]   # one model (quote names containing dots)
    strategy = "qwen-draft"
"""

from __future__ import annotations

import logging
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshnode.errors import MeshnodeError
from meshnode.limits import MAX_VERIFY_WINDOW

__all__ = [
    "ConfigError",
    "HttpSettings",
    "MODES",
    "MeshnodeConfig",
    "ModelSettings",
    "NodeSettings",
    "SpeculativeSettings",
    "WINDOW_POLICIES",
    "WindowSettings",
    "load_config",
    "parse_config",
    "parse_size",
]

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
WINDOW_POLICIES = ("adaptive", "fixed")
MAX_SHUTDOWN_GRACE = 3600.0     # seconds; a longer wait is a mistake, not a setting
MAX_PREFIX_CACHE = 4096         # sessions; the node keeps at most max(1, --parallel - 1) anyway


class ConfigError(MeshnodeError):
    """The config file (or a size string) is malformed. ``path`` and ``key`` say where."""

    def __init__(self, message: str, *, path: Path | str | None = None, key: str | None = None):
        self.path = str(path) if path is not None else None
        self.key = key
        where = ""
        if self.path:
            where = f"{self.path}: "
        if key:
            where += f"{key}: "
        super().__init__(where + message)


@dataclass(frozen=True, slots=True)
class NodeSettings:
    name: str | None = None
    http_port: int | None = None
    quic_port: int | None = None
    max_memory: int | None = None       # bytes
    shutdown_grace: float | None = None  # seconds
    prefix_cache: int | None = None     # sessions kept for prefix reuse (serve/prefix_cache.py)
    busy_poll: bool | None = None       # net/busypoll.py


@dataclass(frozen=True, slots=True)
class HttpSettings:
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    max_body: int | None = None         # bytes
    max_queue: int | None = None
    keep_responses: str | None = None   # "disk" | "memory" (serve/response_disk.py)


@dataclass(frozen=True, slots=True)
class WindowSettings:
    policy: str | None = None           # "adaptive" | "fixed"
    initial: int | None = None
    min: int | None = None
    max: int | None = None


@dataclass(frozen=True, slots=True)
class SpeculativeSettings:
    strategy: str | None = None         # a strategy name: "ngram", "none", or a package's
    mode: str | None = None             # "auto" | "on" | "off"
    draft_model: str | None = None
    window: WindowSettings = field(default_factory=WindowSettings)

    @property
    def is_empty(self) -> bool:
        return self == SpeculativeSettings()


@dataclass(frozen=True, slots=True)
class ModelSettings:
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)


@dataclass(frozen=True, slots=True)
class MeshnodeConfig:
    path: str | None = None             # the file it came from (None: no file)
    node: NodeSettings = field(default_factory=NodeSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    defaults_speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    models: Mapping[str, ModelSettings] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    share: bool | None = None           # [models] share: members may pull this node's models

    def model_speculative(self, model: str) -> SpeculativeSettings:
        """``[models.<model>.speculative]`` (empty settings when absent)."""
        m = self.models.get(model)
        return m.speculative if m is not None else SpeculativeSettings()


# ---- sizes --------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
    "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(text: str | int) -> int:
    """Bytes in ``"6GB"``, ``"1.5 GiB"``, ``"512MB"``, ``"1024"`` or an int.

    SI suffixes (K/KB, M/MB, G/GB, T/TB) are powers of 1000; IEC suffixes (KiB, MiB,
    GiB, TiB) powers of 1024; case does not matter. Raises :class:`ConfigError`.
    """
    if isinstance(text, bool):
        raise ConfigError(f"expected a size such as '6GB', got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must not be negative, got {text}")
        return text
    if not isinstance(text, str):
        raise ConfigError(f"expected a size such as '6GB', got {text!r}")
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(
            f"expected a size such as '6GB', '512MiB' or a number of bytes, got {text!r}"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise ConfigError(f"size too large: {text!r}")
    return int(value)


# ---- parsing ------------------------------------------------------------------


class _Reader:
    """Typed access to one table, with errors naming file + dotted key."""

    def __init__(self, path: str | None, warnings: list[str]):
        self.path = path
        self.warnings = warnings

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(message, path=self.path, key=key)

    def warn_unknown(self, table: Mapping[str, Any], prefix: str, known: tuple[str, ...]) -> None:
        for k in table:
            if k not in known:
                msg = f"{self.path or 'config'}: unknown key {prefix}{k} (ignored)"
                self.warnings.append(msg)
                log.warning("%s", msg)

    def table(self, parent: Mapping[str, Any], key: str, dotted: str) -> Mapping[str, Any]:
        v = parent.get(key, {})
        if not isinstance(v, dict):
            raise self.error(dotted, f"expected a table, got {type(v).__name__} {v!r}")
        return v

    def str_(self, t: Mapping[str, Any], key: str, dotted: str, choices: tuple[str, ...] = ()) -> str | None:
        if key not in t:
            return None
        v = t[key]
        if not isinstance(v, str) or not v:
            raise self.error(dotted, f"expected a non-empty string, got {v!r}")
        if choices and v not in choices:
            raise self.error(dotted, f"expected one of {', '.join(choices)}, got {v!r}")
        return v

    def bool_(self, t: Mapping[str, Any], key: str, dotted: str) -> bool | None:
        if key not in t:
            return None
        if not isinstance(t[key], bool):
            raise self.error(dotted, f"expected true or false, got {t[key]!r}")
        return t[key]

    def strs(self, t: Mapping[str, Any], key: str, dotted: str) -> tuple[str, ...]:
        v = t.get(key, [])
        if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
            raise self.error(dotted, f"expected a list of non-empty strings, got {v!r}")
        return tuple(v)

    def int_(self, t: Mapping[str, Any], key: str, dotted: str, lo: int, hi: int) -> int | None:
        if key not in t:
            return None
        v = t[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(dotted, f"expected an integer in [{lo}, {hi}], got {v!r}")
        if not lo <= v <= hi:
            raise self.error(dotted, f"expected an integer in [{lo}, {hi}], got {v}")
        return v

    def size_(self, t: Mapping[str, Any], key: str, dotted: str, lo: int = 0) -> int | None:
        """A size such as ``"6GB"`` or a number of bytes, at least ``lo`` bytes."""
        if key not in t:
            return None
        try:
            v = parse_size(t[key])
        except ConfigError as e:
            raise self.error(dotted, str(e)) from None
        if v < lo:
            raise self.error(dotted, f"expected at least {lo // 1024}KiB, got {v} bytes")
        return v

    def float_(self, t: Mapping[str, Any], key: str, dotted: str, lo: float, hi: float) -> float | None:
        if key not in t:
            return None
        v = t[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise self.error(dotted, f"expected a number in [{lo:g}, {hi:g}], got {v!r}")
        return float(v)


def _parse_window(r: _Reader, spec: Mapping[str, Any], prefix: str) -> WindowSettings:
    dotted = prefix + "window"
    if "window" not in spec:
        return WindowSettings()
    raw = spec["window"]
    if isinstance(raw, int) and not isinstance(raw, bool):
        # shorthand: window = 8 is a fixed window of 8
        size = r.int_(spec, "window", dotted, 1, MAX_VERIFY_WINDOW)
        return WindowSettings(policy="fixed", initial=size, min=size, max=size)
    if not isinstance(raw, dict):
        raise r.error(dotted, f"expected a table or an integer window size, got {raw!r}")
    r.warn_unknown(raw, dotted + ".", ("policy", "initial", "min", "max"))
    w = WindowSettings(
        policy=r.str_(raw, "policy", dotted + ".policy", WINDOW_POLICIES),
        initial=r.int_(raw, "initial", dotted + ".initial", 1, MAX_VERIFY_WINDOW),
        min=r.int_(raw, "min", dotted + ".min", 1, MAX_VERIFY_WINDOW),
        max=r.int_(raw, "max", dotted + ".max", 1, MAX_VERIFY_WINDOW),
    )
    if w.min is not None and w.max is not None and w.min > w.max:
        raise r.error(dotted, f"min ({w.min}) is larger than max ({w.max})")
    return w


def _parse_spec(r: _Reader, spec: Mapping[str, Any], prefix: str) -> SpeculativeSettings:
    r.warn_unknown(spec, prefix, ("strategy", "mode", "draft_model", "window"))
    return SpeculativeSettings(
        strategy=r.str_(spec, "strategy", prefix + "strategy"),
        mode=r.str_(spec, "mode", prefix + "mode", MODES),
        draft_model=r.str_(spec, "draft_model", prefix + "draft_model"),
        window=_parse_window(r, spec, prefix),
    )


def parse_config(data: Mapping[str, Any] | str, path: Path | str | None = None) -> MeshnodeConfig:
    """Validate a parsed TOML document (or TOML text). Raises :class:`ConfigError`."""
    spath = str(path) if path is not None else None
    if isinstance(data, str):
        try:
            data = tomllib.loads(data)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"not valid TOML: {e}", path=spath) from None
        except RecursionError:   # tomllib recurses per nesting level
            raise ConfigError("not valid TOML: nested too deeply", path=spath) from None
    warnings: list[str] = []
    r = _Reader(spath, warnings)
    r.warn_unknown(data, "", ("node", "http", "defaults", "models"))

    node_t = r.table(data, "node", "node")
    r.warn_unknown(node_t, "node.", ("name", "http_port", "quic_port", "max_memory", "shutdown_grace",
                                   "prefix_cache", "busy_poll"))
    node = NodeSettings(
        name=r.str_(node_t, "name", "node.name"),
        http_port=r.int_(node_t, "http_port", "node.http_port", 0, 65535),
        quic_port=r.int_(node_t, "quic_port", "node.quic_port", 0, 65535),
        max_memory=r.size_(node_t, "max_memory", "node.max_memory"),
        shutdown_grace=r.float_(node_t, "shutdown_grace", "node.shutdown_grace", 0, MAX_SHUTDOWN_GRACE),
        prefix_cache=r.int_(node_t, "prefix_cache", "node.prefix_cache", 0, MAX_PREFIX_CACHE),
        busy_poll=r.bool_(node_t, "busy_poll", "node.busy_poll"),
    )

    http_t = r.table(data, "http", "http")
    r.warn_unknown(http_t, "http.", ("api_key", "allowed_hosts", "cors_origins", "max_body", "max_queue",
                                   "keep_responses"))
    http = HttpSettings(
        api_key=r.str_(http_t, "api_key", "http.api_key"),
        allowed_hosts=r.strs(http_t, "allowed_hosts", "http.allowed_hosts"),
        cors_origins=r.strs(http_t, "cors_origins", "http.cors_origins"),
        max_body=r.size_(http_t, "max_body", "http.max_body", lo=1024),
        max_queue=r.int_(http_t, "max_queue", "http.max_queue", 0, 100_000),
        keep_responses=r.str_(http_t, "keep_responses", "http.keep_responses", ("disk", "memory")),
    )

    defaults_t = r.table(data, "defaults", "defaults")
    r.warn_unknown(defaults_t, "defaults.", ("speculative",))
    defaults_spec = _parse_spec(
        r, r.table(defaults_t, "speculative", "defaults.speculative"), "defaults.speculative."
    )

    models_t = r.table(data, "models", "models")
    models: dict[str, ModelSettings] = {}
    share = None
    for name in models_t:
        if name == "share" and not isinstance(models_t[name], dict):   # [models] share = bool
            share = r.bool_(models_t, "share", "models.share")
            continue
        mt = r.table(models_t, name, f"models.{name}")
        r.warn_unknown(mt, f"models.{name}.", ("speculative",))
        prefix = f"models.{name}.speculative."
        spec = _parse_spec(r, r.table(mt, "speculative", prefix[:-1]), prefix)
        models[name] = ModelSettings(speculative=spec)

    return MeshnodeConfig(
        path=spath,
        node=node,
        http=http,
        defaults_speculative=defaults_spec,
        models=models,
        warnings=tuple(warnings),
        share=share,
    )


def load_config(path: Path | str) -> MeshnodeConfig:
    """Read and validate ``path`` (usually ``NodePaths.config_file``).

    A missing file is an empty config. Unreadable files and invalid content raise
    :class:`ConfigError`.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return MeshnodeConfig(path=str(p))
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror or e}", path=p) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8 text", path=p) from None
    return parse_config(text, p)
