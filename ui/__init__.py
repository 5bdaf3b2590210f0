"""The meshnode terminal UI (Textual).

Depends on the node only through :mod:`meshnode.state` (snapshots, events, NodeAPI);
nothing in ``meshnode`` imports this package except lazily, from the CLI handler that
opens the TUI. Public entry points: :func:`ui.app.run_tui` and :func:`ui.app.make_app`.
"""

from ui.app import MeshnodeApp, make_app, run_tui

__all__ = ["MeshnodeApp", "make_app", "run_tui"]
