"""One line at the top of every screen: who we are, what we serve, and the node's state."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Static

from meshnode.state import NodeSnapshot


class StatusBar(Horizontal):
    DEFAULT_CSS = """
    StatusBar {
        height: 1;
        dock: top;
        background: $panel;
    }
    StatusBar > #status-left { width: 1fr; height: 1; text-wrap: nowrap; text-overflow: ellipsis; }
    StatusBar > #status-right { width: auto; max-width: 50%; height: 1; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, title: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.title = title

    def compose(self) -> ComposeResult:
        yield Static(id="status-left")
        yield Static(id="status-right")

    def show(self, snap: NodeSnapshot | None, node_state: str, detail: str = "") -> None:
        left = Text()
        left.append(f" {self.title} ", style="bold reverse")
        if snap is not None:
            left.append(f" {snap.node.name}", style="bold")
            left.append(f" · {snap.model or 'no model'}")
            left.append(f" · {len(snap.peers)} peer{'s' if len(snap.peers) != 1 else ''}")
            active = sum(r.finished_at is None for r in snap.requests)
            if active:
                left.append(f" · {active} active")
        right = Text()
        match node_state:
            case "running":
                right.append("● running", style="green")
            case "starting":
                right.append("◌ starting", style="yellow")
                if snap is not None and snap.transfers:
                    t = snap.transfers[0]
                    pct = 100 * t.done_bytes / t.total_bytes if t.total_bytes else 0
                    right.append(f" · {t.what} {t.name} {pct:.0f}%")
            case "stopping":
                right.append("◌ stopping", style="yellow")
            case "failed":
                right.append("✗ failed", style="bold red")
            case _:
                right.append(node_state)
        if detail:
            right.append(f" · {detail}", style="red")
        right.append(" ")
        self.query_one("#status-left", Static).update(left)
        self.query_one("#status-right", Static).update(right)
