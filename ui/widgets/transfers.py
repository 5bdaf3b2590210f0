"""Downloads, slicing, loading and peer transfers with progress bars."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, ProgressBar

from meshnode.state import TransferInfo
from ui.format import fmt_bytes


class TransferRow(Horizontal):
    DEFAULT_CSS = """
    TransferRow { height: 1; }
    TransferRow > .transfer-name { width: 1fr; text-wrap: nowrap; text-overflow: ellipsis; }
    TransferRow > ProgressBar { width: auto; margin: 0 1; }
    TransferRow > ProgressBar Bar { width: 20; }
    TransferRow > .transfer-bytes { width: 20; text-align: right; }
    """

    def __init__(self, info: TransferInfo) -> None:
        super().__init__()
        self.info = info

    def compose(self) -> ComposeResult:
        yield Label(classes="transfer-name")
        yield ProgressBar(total=None, show_eta=False)
        yield Label(classes="transfer-bytes")

    def on_mount(self) -> None:
        self.show(self.info)

    def show(self, info: TransferInfo) -> None:
        """Show ``info``; safe before the row is composed (on_mount shows the latest)."""
        self.info = info
        if not self.children:
            return
        self.query_one(".transfer-name", Label).update(f"{info.what}: {info.name}")
        bar = self.query_one(ProgressBar)
        bar.update(total=max(info.total_bytes, 1), progress=info.done_bytes)
        self.query_one(".transfer-bytes", Label).update(
            f"{fmt_bytes(info.done_bytes)}/{fmt_bytes(info.total_bytes)}"
        )


class TransferList(Vertical):
    DEFAULT_CSS = """
    TransferList { height: auto; }
    TransferList > .transfer-none { color: $text-muted; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._keys: tuple[tuple[str, str], ...] | None = None

    def show(self, transfers: Sequence[TransferInfo]) -> None:
        keys = tuple((t.what, t.name) for t in transfers)
        if keys == self._keys:
            for row, info in zip(self.query(TransferRow), transfers):
                row.show(info)
            return
        self._keys = keys
        self.remove_children()
        if transfers:
            self.mount_all([TransferRow(t) for t in transfers])
        else:
            self.mount(Label("no transfers", classes="transfer-none"))
