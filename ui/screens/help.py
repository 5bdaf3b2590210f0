"""Help: every key binding of the app and of each screen, read from the bindings themselves."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

_KEY_NAMES = {"question_mark": "?", "escape": "Esc"}


def _key(binding: Binding) -> str:
    return ", ".join(_KEY_NAMES.get(k, k) for k in binding.key.split(","))


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "Close help")]

    def compose(self) -> ComposeResult:
        from ui.app import SCREENS, MeshnodeApp  # the app owns the list of screens

        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        table.add_row(Text("Everywhere", style="underline"), "")
        for b in MeshnodeApp.BINDINGS:
            if isinstance(b, Binding) and b.show:
                table.add_row(_key(b), b.tooltip or b.description)
        table.add_row("F1..F7", "Switch screens, also while typing")
        table.add_row("ctrl+q", "Quit, also while typing")
        for _, title, cls in SCREENS:
            own = [b for b in cls.__dict__.get("BINDINGS", ()) if isinstance(b, Binding)]
            if own:
                table.add_row(Text(title, style="underline"), "")
                for b in own:
                    table.add_row(_key(b), b.tooltip or b.description)
        box = VerticalScroll(Static(table), id="help-box")
        box.border_title = "meshnode · keys"
        box.border_subtitle = "Esc, ? or q closes"
        yield box
