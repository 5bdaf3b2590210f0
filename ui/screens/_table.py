"""Refilling a DataTable from a snapshot without losing the user's place."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import DataTable

Cell = str | Text


def fill_table(table: DataTable, rows: Sequence[tuple[str, Sequence[Cell]]]) -> None:
    """Replace the rows of ``table`` with ``rows`` (key, cells), keeping the cursor's row."""
    current = [(str(k.value), tuple(str(c) for c in table.get_row(k))) for k in table.rows]
    wanted = [(key, tuple(str(c) for c in cells)) for key, cells in rows]
    if current == wanted:
        return
    keep: str | None = None
    if table.row_count and table.cursor_row < table.row_count:
        keep = str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)
    table.clear()
    for key, cells in rows:
        table.add_row(*cells, key=key)
    if keep is not None:
        try:
            table.move_cursor(row=table.get_row_index(keep), animate=False)
        except Exception:  # the row went away: the cursor stays where clear() put it
            pass
