"""Models: local models and layer packages, the models served in the mesh (any node's
endpoint takes requests for them), the models peers hold, transfers."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Label

from meshnode.state import NodeSnapshot
from ui.format import fmt_bytes, fmt_size, peer_text
from ui.screens._table import fill_table
from ui.screens.base import NodeScreen
from ui.widgets import TransferList


class ModelsScreen(NodeScreen):
    TITLE = "Models"

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="models-body"):
            yield Label("On this node", classes="section")
            yield DataTable(id="local-models", cursor_type="row", zebra_stripes=True)
            yield Label("Served in the mesh (this node's endpoint takes requests for each)", classes="section")
            yield DataTable(id="served-models", cursor_type="row", zebra_stripes=True)
            yield Label("In the mesh", classes="section")
            yield DataTable(id="mesh-models", cursor_type="row", zebra_stripes=True)
            yield Label("Downloads and transfers", classes="section")
            yield TransferList(id="transfers")

    def on_mount(self) -> None:
        self.query_one("#local-models", DataTable).add_columns(
            "Name", "Kind", "Layers", "Size", "Source", "sha256"
        )
        self.query_one("#served-models", DataTable).add_columns("Name", "Coordinated by", "Context")
        self.query_one("#mesh-models", DataTable).add_columns("Name", "Layers", "Size", "Held by")
        super().on_mount()

    def show_snapshot(self, snap: NodeSnapshot) -> None:
        local = []
        for m in snap.models:
            # (columns kept narrow enough for 80 columns: the range shows once, sizes are compact)
            name, layers = m.name, f"{m.n_layers} {m.architecture}"
            if m.layer_range:
                layers = f"[{m.layer_range[0]},{m.layer_range[1]})"
                name = name.removesuffix(f" {layers}")
            local.append((f"{m.sha256}:{m.path}", [name, m.kind, layers, fmt_size(m.size_bytes),
                                                   m.source, m.sha256[:8]]))
        fill_table(self.query_one("#local-models", DataTable), local)

        served = [
            (f"{m.coordinator_id}:{m.name}",
             [peer_text(m.name, 100), "this node" if m.local else peer_text(m.coordinator_name or m.coordinator_id, 64),
              str(m.n_ctx) if m.n_ctx else "?"])
            for m in snap.mesh_models
        ]
        fill_table(self.query_one("#served-models", DataTable), served)

        held: dict[str, tuple[str, int, int, list[str]]] = {}
        for p in sorted(snap.peers, key=lambda p: p.name):
            for hm in p.capabilities.models if p.capabilities else ():
                name, n_layers, size, holders = held.setdefault(hm.sha256, (hm.name, hm.n_layers, hm.size_bytes, []))
                holders.append(p.name)
        for hm in snap.node.capabilities.models:
            held.setdefault(hm.sha256, (hm.name, hm.n_layers, hm.size_bytes, []))[3].insert(0, snap.node.name)
        mesh = [
            (sha, [peer_text(name, 100), str(n_layers), fmt_bytes(size), peer_text(", ".join(holders), 200)])
            for sha, (name, n_layers, size, holders) in sorted(held.items(), key=lambda kv: kv[1][0])
        ]
        fill_table(self.query_one("#mesh-models", DataTable), mesh)
        self.query_one(TransferList).show(snap.transfers)
