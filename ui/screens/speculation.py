"""Speculation: per-strategy statistics, acceptance over time, and the live drafts view."""

from __future__ import annotations

import re

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Label, RichLog

from meshnode.state import NodeSnapshot, SpecState, format_step_costs
from ui.feed import EventFeed
from ui.format import fmt_ahead, fmt_ms, render_draft
from ui.screens._table import fill_table
from ui.screens.base import NodeScreen
from ui.widgets import MetricRow

_STATE_STYLE = {
    SpecState.OFF: "dim",
    SpecState.COLD: "blue",
    SpecState.ENABLED: "green",
    SpecState.COOLING_DOWN: "yellow",
}


class SpeculationScreen(NodeScreen):
    TITLE = "Speculation"

    def __init__(self) -> None:
        super().__init__()
        self._drafts_seen = 0

    def compose_body(self) -> ComposeResult:
        with Vertical(id="spec-body"):
            yield DataTable(id="spec-stats", cursor_type="none")
            # what sizes the windows: the learned step cost per window, the acceptance estimate
            yield Label("", id="spec-costs")
            yield Label("Acceptance per window (recent)", classes="section")
            yield Vertical(id="acceptance")
            yield Label("Drafts  ✓ accepted  ✗ rejected  → bonus", classes="section")
            yield RichLog(id="drafts", max_lines=500, wrap=True, markup=False, min_width=1)

    def on_mount(self) -> None:
        self.query_one("#spec-stats", DataTable).add_columns(
            "Strategy", "State", "Win", "Accept", "Proposed", "Accepted", "Windows", "Verify", "Ahead"
        )
        super().on_mount()

    def show_snapshot(self, snap: NodeSnapshot) -> None:
        rows = [
            (
                s.strategy,
                [
                    Text(s.strategy, style="bold"),
                    Text(s.state.value, style=_STATE_STYLE[s.state]),
                    # the window is only meaningful while drafting
                    str(s.current_window) if s.state is SpecState.ENABLED else "-",
                    f"{100 * s.acceptance:.0f}%",
                    str(s.proposed),
                    str(s.accepted),
                    str(s.windows),
                    fmt_ms(s.verify_ms) if s.windows else "-",
                    fmt_ahead(s.lookahead_used, s.lookahead),
                ],
            )
            for s in snap.spec
        ]
        fill_table(self.query_one("#spec-stats", DataTable), rows)
        self.query_one("#spec-costs", Label).update("\n".join(
            f"{s.strategy} step cost by drafts: {format_step_costs(s.step_ms)}; "
            f"acceptance estimate {100 * s.acceptance_estimate:.0f}%"
            for s in snap.spec if s.step_ms))

    def show_feed(self, feed: EventFeed) -> None:
        box = self.query_one("#acceptance", Vertical)
        for strategy, history in feed.acceptance().items():
            row_id = "acc-" + re.sub(r"[^A-Za-z0-9_-]", "_", strategy)
            rows = box.query(f"#{row_id}")
            if rows:
                row = rows.first(MetricRow)
            else:
                row = MetricRow(strategy, id=row_id)
                box.mount(row)
            recent = history[-8:]
            row.show(f"{100 * sum(recent) / len(recent):.0f}% last {len(recent)}", history)
        log = self.query_one("#drafts", RichLog)
        for seq, draft in feed.drafts.since(self._drafts_seen):
            log.write(render_draft(draft))
            self._drafts_seen = seq
