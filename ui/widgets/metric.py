"""A metric row: name, current value, and a sparkline of its recent history.

The sparkline draws one column per sample, newest at the right, scaled from 0 to the
largest value shown. (Textual's Sparkline stretches few samples over the whole width and
scales min..max, so one sample, or a constant 0 B/s, fills the row with full blocks.)
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Label

BARS = "▁▂▃▄▅▆▇█"


def spark_text(values: Sequence[float], width: int) -> str:
    """The last ``width`` values as bar glyphs, 0 .. max(values) -> ▁ .. █."""
    shown = [max(0.0, v) for v in values[-width:]] if width > 0 else []
    top = max(shown, default=0.0)
    if top <= 0:
        return BARS[0] * len(shown)
    return "".join(BARS[min(len(BARS) - 1, round(v / top * (len(BARS) - 1)))] for v in shown)


class SparkBar(Widget):
    DEFAULT_CSS = """
    SparkBar { height: 1; width: 1fr; color: $accent; }
    """

    data: reactive[tuple[float, ...]] = reactive(())

    def render(self) -> Text:
        return Text(spark_text(self.data, self.size.width).rjust(self.size.width))


class MetricRow(Horizontal):
    DEFAULT_CSS = """
    MetricRow { height: auto; }
    MetricRow > .metric-name { width: 16; }
    MetricRow > .metric-value { width: 12; text-align: right; margin-right: 1; text-style: bold; }
    """

    def __init__(self, name: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self._name = name
        self._value = "-"
        self._history: tuple[float, ...] = ()

    def compose(self) -> ComposeResult:
        yield Label(self._name, classes="metric-name")
        yield Label(self._value, classes="metric-value")
        spark = SparkBar()
        spark.data = self._history
        yield spark

    @property
    def value(self) -> str:
        return self._value

    def show(self, value: str, history: Sequence[float]) -> None:
        """Set the current value and history; safe to call before the row is mounted."""
        self._value, self._history = value, tuple(history)
        if self.children:
            self.query_one(".metric-value", Label).update(value)
            self.query_one(SparkBar).data = self._history
