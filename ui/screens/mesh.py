"""Mesh: this node and its peers, the stage map, and transfers while the node starts."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Label, Static

from meshnode.state import ModelStatus, NodeSnapshot, PeerInfo, node_labels
from ui.format import fmt_ms, fmt_size
from ui.screens._table import fill_table
from ui.screens.base import NodeScreen
from ui.widgets import StageMap, TransferList
from ui.widgets.status_bar import service_status


def _mem(caps) -> tuple[str, str]:
    if caps is None:
        return "-", "-"
    backend = caps.backend
    if caps.free_vram_bytes:
        backend += f" {fmt_size(caps.free_vram_bytes)}"
    return fmt_size(caps.free_ram_bytes), backend


def _auth(ok: bool, lane: bool = False) -> Text:
    if not ok:
        return Text("✗ no", style="bold red")
    return Text("✓ yes · lane" if lane else "✓ yes", style="green")


class MeshScreen(NodeScreen):
    TITLE = "Mesh"

    def compose_body(self) -> ComposeResult:
        with Vertical(id="mesh-body"):
            yield Label("Nodes  (* this node)", classes="section")
            yield DataTable(id="nodes", cursor_type="row", zebra_stripes=True)
            yield Label("Stage map", classes="section", id="stage-title")
            yield Static(id="service-status")
            yield StageMap(id="stage-map")
            yield Label("Transfers", classes="section", id="transfers-title")
            yield TransferList(id="transfers")

    def on_mount(self) -> None:
        table = self.query_one("#nodes", DataTable)
        table.add_columns("Name", "Address", "RTT", "RAM", "Backend", "Auth", "Role")
        super().on_mount()

    def show_snapshot(self, snap: NodeSnapshot) -> None:
        me = snap.node
        my_role = ", ".join(
            f"S{s.index} [{s.layer_start},{s.layer_end})" for s in snap.stages if s.node_id == me.node_id
        )
        ram, backend = _mem(me.capabilities)
        address = "-" if me.address.endswith(":0") else me.address  # QUIC not bound yet
        labels = node_labels([(me.node_id, me.name), *((p.node_id, p.name) for p in snap.peers),
                              *((s.node_id, s.node_name) for s in snap.stages)])
        rows = [(me.node_id, [Text(f"{labels[me.node_id]} *", style="bold"), address, "-", ram, backend,
                             Text("self", style="dim"), my_role or "idle"])]
        for p in sorted(snap.peers, key=lambda p: p.name):
            rows.append((p.node_id, self._peer_row(p, labels[p.node_id])))
        fill_table(self.query_one("#nodes", DataTable), rows)
        self.query_one(StageMap).show(snap.stages, snap.model_layers, labels)
        title = f"Stage map · {snap.model} · {snap.model_layers} layers" if snap.model else "Stage map"
        self.query_one("#stage-title", Label).update(title)
        # The model service's start-up (fetch, wait for peers, plan) or failure, in full:
        # the status bar has room for one line only.
        service = self.query_one("#service-status", Static)
        service.display = snap.status not in (ModelStatus.UNKNOWN, ModelStatus.READY)
        if service.display:
            glyph, text, style = service_status(snap)
            service.update(Text(f"{glyph} model: {text}", style=style))
        has_transfers = bool(snap.transfers)
        self.query_one("#transfers-title").display = has_transfers
        transfers = self.query_one(TransferList)
        transfers.display = has_transfers
        transfers.show(snap.transfers)

    @staticmethod
    def _peer_row(p: PeerInfo, label: str) -> list:
        ram, backend = _mem(p.capabilities)
        return [Text(label), p.address, fmt_ms(p.rtt_ms), ram, backend, _auth(p.authenticated, p.lane), p.role or "idle"]
