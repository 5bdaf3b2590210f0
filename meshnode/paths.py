"""Where a node keeps its files.

A node's *home* decides every path. By default the platform's directories are used
(platformdirs: data, cache, config); ``--home DIR`` or ``MESHNODE_HOME`` put everything
under one folder instead, which is how several nodes share one machine in tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from meshnode.errors import MeshnodeError

APP_NAME = "meshnode"
HOME_ENV = "MESHNODE_HOME"


@dataclass(frozen=True, slots=True)
class NodePaths:
    data: Path      # models, layer packages we serve (survives cache clears)
    cache: Path     # downloads in progress, derived slices
    config: Path    # config.toml, identity, mesh secret fallback
    state: Path     # runtime files of a running node (ports, pid)

    @classmethod
    def resolve(cls, home: str | os.PathLike[str] | None = None) -> "NodePaths":
        """Paths for ``home`` (or ``$MESHNODE_HOME``, or the platform defaults)."""
        home = home or os.environ.get(HOME_ENV) or None
        if home:
            root = Path(home).expanduser().resolve()
            if root.exists() and not root.is_dir():
                raise MeshnodeError(f"home {home}: not a directory (--home or ${HOME_ENV} names the "
                                    "folder a node keeps its files in)")
            return cls(root / "data", root / "cache", root / "config", root / "state")
        return cls(
            Path(platformdirs.user_data_dir(APP_NAME)),
            Path(platformdirs.user_cache_dir(APP_NAME)),
            Path(platformdirs.user_config_dir(APP_NAME)),
            Path(platformdirs.user_state_dir(APP_NAME)),
        )

    @property
    def models(self) -> Path:
        return self.data / "models"

    @property
    def slices(self) -> Path:
        return self.cache / "slices"

    @property
    def identity(self) -> Path:
        return self.config / "identity"

    @property
    def config_file(self) -> Path:
        return self.config / "config.toml"

    @property
    def runtime_file(self) -> Path:
        """JSON written by a running node: pid, HTTP port, QUIC port (read by `meshnode status`)."""
        return self.state / "node.json"

    def ensure(self) -> "NodePaths":
        for p in (self.data, self.cache, self.config, self.state, self.models, self.slices):
            try:
                p.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise MeshnodeError(f"cannot create {p}: {exc.strerror or exc}") from exc
        return self
