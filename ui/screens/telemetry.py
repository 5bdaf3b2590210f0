"""Telemetry: tokens/s, TTFT, TPOT, per-hop latency and link traffic over time."""

from __future__ import annotations

from collections.abc import Callable

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Label

from meshnode.state import NodeSnapshot, TelemetryPoint
from ui.format import fmt_ms, fmt_rate, peer_text
from ui.screens._table import fill_table
from ui.screens.base import NodeScreen
from ui.widgets import MetricRow

# (id, label, field getter, formatter of the current value)
METRICS: tuple[tuple[str, str, Callable[[TelemetryPoint], float | None], Callable[[float | None], str]], ...] = (
    ("tps", "tokens/s", lambda p: p.tokens_per_s, lambda v: "-" if v is None else f"{v:.1f}"),
    ("ttft", "time to 1st tok", lambda p: p.ttft_ms, fmt_ms),
    ("tpot", "time per token", lambda p: p.tpot_ms, fmt_ms),
    ("hop", "hop latency", lambda p: p.hop_ms, fmt_ms),
    ("link", "link traffic", lambda p: p.link_bytes_per_s, fmt_rate),
)


class TelemetryScreen(NodeScreen):
    TITLE = "Telemetry"

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="telemetry-body"):
            yield Label("Now and recent history", classes="section", id="telemetry-title")
            for key, label, _, _ in METRICS:
                yield MetricRow(label, id=f"metric-{key}", classes="metric")
            yield Label("Links", classes="section")
            yield DataTable(id="links", cursor_type="none", zebra_stripes=True)

    def on_mount(self) -> None:
        self.query_one("#links", DataTable).add_columns("Peer", "RTT", "In", "Out")
        super().on_mount()

    def show_snapshot(self, snap: NodeSnapshot) -> None:
        points = snap.telemetry
        span = points[-1].t - points[0].t if len(points) > 1 else 0.0
        self.query_one("#telemetry-title", Label).update(
            (f"Now and the last {span:.0f} s ({len(points)} sample{'s' if len(points) != 1 else ''})"
             if points else "No samples yet (one per finished request)")
        )
        for key, _, get, fmt in METRICS:
            values = [get(p) for p in points]
            current = next((v for v in reversed(values) if v is not None), None)
            history = [v for v in values if v is not None]
            self.query_one(f"#metric-{key}", MetricRow).show(fmt(current), history)
        rows = [
            (p.node_id, [peer_text(p.name), fmt_ms(p.rtt_ms), fmt_rate(p.bytes_per_s_in), fmt_rate(p.bytes_per_s_out)])
            for p in sorted(snap.peers, key=lambda p: p.name)
        ]
        fill_table(self.query_one("#links", DataTable), rows)
