"""A metric row: name, current value, and a sparkline of its recent history."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, Sparkline


class MetricRow(Horizontal):
    DEFAULT_CSS = """
    MetricRow { height: auto; }
    MetricRow > .metric-name { width: 16; }
    MetricRow > .metric-value { width: 12; text-align: right; margin-right: 1; text-style: bold; }
    MetricRow > Sparkline { width: 1fr; height: 1; }
    """

    def __init__(self, name: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self._name = name
        self._value = "-"
        self._history: list[float] = []

    def compose(self) -> ComposeResult:
        yield Label(self._name, classes="metric-name")
        yield Label(self._value, classes="metric-value")
        yield Sparkline(self._history)

    def show(self, value: str, history: Sequence[float]) -> None:
        """Set the current value and history; safe to call before the row is mounted."""
        self._value, self._history = value, list(history)
        if self.children:
            self.query_one(".metric-value", Label).update(value)
            self.query_one(Sparkline).data = self._history
