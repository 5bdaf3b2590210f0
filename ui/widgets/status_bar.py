"""One line at the top of every screen: who we are, what we serve, and the node's state.

The right-hand side combines two states: the node process as the app sees it
(``starting`` until ``node.start()`` returns, ``running``, ``stopping``, ``failed``) and,
once it runs, the model service's state from the snapshot (``NodeSnapshot.status``:
fetching with the first transfer's progress, waiting for peers, planning with the
stages ready so far, ready, failed with the reason). Every state has a glyph as well
as a colour (``●`` ready, ``◌`` in progress, ``✗`` failed, ``○`` no model).
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Static

from meshnode.state import ModelStatus, NodeSnapshot, StageState, TransferInfo


def transfer_progress(t: TransferInfo) -> str:
    """``extract 45%`` (or just the phase while the total is unknown)."""
    if t.total_bytes:
        return f"{t.what} {100 * t.done_bytes / t.total_bytes:.0f}%"
    return t.what


def service_status(snap: NodeSnapshot | None) -> tuple[str, str, str]:
    """(glyph, text, style) of the model service in ``snap``, for the status bar and Mesh."""
    status = snap.status if snap is not None else ModelStatus.UNKNOWN
    detail = snap.status_detail if snap is not None else ""
    match status:
        case ModelStatus.UNKNOWN:  # a node that does not report its model service
            return "●", "running", "green"
        case ModelStatus.READY:
            text = "ready" + (f" · {detail}" if detail else "")
            if snap is not None and snap.failovers:
                last = snap.failovers[0]
                text += f" · re-planned {len(snap.failovers)}× (last: serving again in {last.resume_ms / 1e3:.1f} s)"
            return "●", text, "green"
        case ModelStatus.RECOVERING:
            return "◌", "recovering" + (f" · {detail}" if detail else ""), "yellow"
        case ModelStatus.FETCHING:
            text = "fetching" + (f" {detail}" if detail else "")
            if snap is not None and snap.transfers:
                text += f" · {transfer_progress(snap.transfers[0])}"
            return "◌", text, "yellow"
        case ModelStatus.PLANNING:
            text = "planning"
            if snap is not None and snap.stages:
                ready = sum(s.state is StageState.READY for s in snap.stages)
                text += f" · {ready}/{len(snap.stages)} stages ready"
            return "◌", text + (f" · {detail}" if detail else ""), "yellow"
        case ModelStatus.WAITING_FOR_PEERS:
            return "◌", "waiting for peers" + (f" · {detail}" if detail else ""), "yellow"
        case ModelStatus.FAILED:
            return "✗", "failed" + (f": {detail}" if detail else ""), "bold red"
        case ModelStatus.NO_MODEL:
            return "○", "no model (lending memory)", "dim"
        case _:
            return "◌", status + (f" · {detail}" if detail else ""), "yellow"


class StatusBar(Horizontal):
    DEFAULT_CSS = """
    StatusBar {
        height: 1;
        dock: top;
        background: $panel;
    }
    StatusBar > #status-left { width: 1fr; height: 1; text-wrap: nowrap; text-overflow: ellipsis; }
    StatusBar > #status-right { width: auto; max-width: 60%; height: 1; text-wrap: nowrap; text-overflow: ellipsis; }
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
                glyph, text, style = service_status(snap)
                if snap is not None and snap.status is ModelStatus.FAILED:
                    text = "model " + text  # the node itself still runs
                right.append(f"{glyph} {text}", style=style)
            case "starting":
                right.append("◌ starting", style="yellow")
                if snap is not None and snap.transfers:
                    t = snap.transfers[0]
                    right.append(f" · {t.name} {transfer_progress(t)}")
            case "stopping":
                right.append("◌ stopping", style="yellow")
            case ModelStatus.FAILED:
                right.append("✗ failed", style="bold red")
            case _:
                right.append(node_state)
        if detail:
            right.append(f" · {detail}", style="red")
        right.append(" ")
        self.query_one("#status-left", Static).update(left)
        self.query_one("#status-right", Static).update(right)
