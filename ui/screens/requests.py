"""Requests: active and recent requests with token counts, speed and status."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable, Label

from meshnode.state import NodeSnapshot, RequestInfo
from ui.format import fmt_duration, fmt_ms, short_id
from ui.screens._table import fill_table
from ui.screens.base import NodeScreen

_STATUS_STYLE = {
    "queued": "blue",
    "prefill": "yellow",
    "decoding": "bold green",
    "done": "dim",
    "cancelled": "yellow",
    "error": "bold red",
}


class RequestsScreen(NodeScreen):
    TITLE = "Requests"

    def compose_body(self) -> ComposeResult:
        yield Label("Active and recent requests", classes="section", id="requests-title")
        yield DataTable(id="requests", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        self.query_one("#requests", DataTable).add_columns(
            "Request", "Status", "Prompt", "Gen", "tok/s", "TTFT", "Time", "Spec"
        )
        super().on_mount()

    def _row(self, r: RequestInfo, now: float) -> list:
        elapsed = (r.finished_at if r.finished_at is not None else now) - r.started_at
        return [
            short_id(r.request_id),
            Text(r.status, style=_STATUS_STYLE.get(r.status, "")),
            str(r.prompt_tokens),
            str(r.generated_tokens),
            f"{r.tokens_per_s:.1f}",
            fmt_ms(r.ttft_ms),
            fmt_duration(elapsed),
            r.strategy or "-",
        ]

    def show_snapshot(self, snap: NodeSnapshot) -> None:
        now = self.mesh_app.clock()
        active = sum(r.finished_at is None for r in snap.requests)
        # A node serves one model, so it goes in the title, not in a column (80 columns).
        models = sorted({r.model for r in snap.requests} or ({snap.model} if snap.model else set()))
        self.query_one("#requests-title", Label).update(
            f"Requests · {active} active · {len(snap.requests) - active} recent"
            + (f" · {', '.join(models)}" if models else "")
        )
        rows = [(r.request_id, self._row(r, now)) for r in snap.requests]
        fill_table(self.query_one("#requests", DataTable), rows)
