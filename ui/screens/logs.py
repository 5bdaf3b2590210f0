"""Logs: the node's log lines (LogEmitted events), filtered by minimum level."""

from __future__ import annotations

import logging

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.reactive import reactive
from textual.widgets import Label, RichLog, Select

from meshnode.state import LogEmitted
from ui.feed import EventFeed
from ui.format import fmt_clock, level_name, level_style
from ui.screens.base import NodeScreen

LEVELS = (
    ("debug", logging.DEBUG),
    ("info", logging.INFO),
    ("warning", logging.WARNING),
    ("error", logging.ERROR),
)


class LogsScreen(NodeScreen):
    TITLE = "Logs"
    BINDINGS = [
        Binding("l", "next_level", "Level", tooltip="Cycle the minimum level"),
        Binding("d", "level(10)", "Show debug and above", show=False),
        Binding("i", "level(20)", "Show info and above", show=False),
        Binding("w", "level(30)", "Show warnings and errors", show=False),
        Binding("e", "level(40)", "Show errors only", show=False),
    ]

    min_level: reactive[int] = reactive(logging.DEBUG, init=False)

    def __init__(self) -> None:
        super().__init__()
        self._seen = 0

    def compose_body(self) -> ComposeResult:
        with Horizontal(id="logs-bar"):
            yield Label("Level ≥ ", id="level-label")
            yield Select(
                [(name, level) for name, level in LEVELS],
                value=logging.DEBUG,
                allow_blank=False,
                compact=True,
                id="level",
            )
            yield Label("", id="logs-count")
        # min_width=1: RichLog wraps at 78 columns at least by default, wider than an
        # 80-column terminal less padding and scrollbar (lines were cut at the edge)
        yield RichLog(id="log", max_lines=5000, wrap=True, markup=False, min_width=1)

    def action_next_level(self) -> None:
        levels = [level for _, level in LEVELS]
        i = levels.index(self.min_level) if self.min_level in levels else -1
        self.action_level(levels[(i + 1) % len(levels)])

    def action_level(self, level: int) -> None:
        self.query_one("#level", Select).value = level

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "level" and isinstance(event.value, int):
            self.min_level = event.value

    def watch_min_level(self, _: int) -> None:
        self.query_one("#log", RichLog).clear()
        self._seen = 0
        self.show_feed(self.mesh_app.feed)

    def _line(self, ev: LogEmitted) -> Text:
        line = Text()
        line.append(fmt_clock(ev.t, self.mesh_app.tz) + " ", style="dim")
        line.append(f"{level_name(ev.level):<5} ", style=level_style(ev.level) or "bold")
        line.append(f"{ev.logger}: ", style="cyan")
        line.append(ev.message)
        return line

    def show_feed(self, feed: EventFeed) -> None:
        log = self.query_one("#log", RichLog)
        for seq, ev in feed.logs.since(self._seen):
            if ev.level >= self.min_level:
                log.write(self._line(ev))
            self._seen = seq
        shown = sum(1 for _, ev in feed.logs.items if ev.level >= self.min_level)
        self.query_one("#logs-count", Label).update(f"  {shown} of {len(feed.logs.items)} lines")
