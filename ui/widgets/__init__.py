"""Reusable widgets of the meshnode TUI (each carries its own DEFAULT_CSS)."""

from ui.widgets.metric import MetricRow
from ui.widgets.stage_map import StageMap
from ui.widgets.status_bar import StatusBar
from ui.widgets.transfers import TransferList

__all__ = ["MetricRow", "StageMap", "StatusBar", "TransferList"]
