"""The base of every main screen: a status bar, a body, the footer.

The app sets :attr:`NodeScreen.snapshot` on the active screen at a bounded rate; the
screen draws in ``watch_snapshot`` -> :meth:`show_snapshot`. New events (drafts, log
lines) arrive through :meth:`show_feed`, also throttled by the app. A screen that was
hidden catches up from the app's latest snapshot and feed when it is shown again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.css.query import NoMatches
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer

from meshnode.state import NodeSnapshot
from ui.feed import EventFeed
from ui.widgets import StatusBar

if TYPE_CHECKING:
    from ui.app import MeshnodeApp


class NodeScreen(Screen):
    TITLE = ""

    snapshot: reactive[NodeSnapshot | None] = reactive(None, init=False)

    #: True once mounted (subclasses' on_mount, e.g. a table's columns, has run). The app
    #: may hand a snapshot to a screen it has just switched to before that: such a
    #: snapshot is only stored, and drawn by :meth:`catch_up` from on_mount.
    ready = False

    @property
    def mesh_app(self) -> MeshnodeApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        yield StatusBar(self.TITLE)
        yield from self.compose_body()
        yield Footer(show_command_palette=False, compact=True)

    def compose_body(self) -> ComposeResult:
        yield from ()

    def on_mount(self) -> None:
        self.ready = True
        self.catch_up()

    def on_screen_resume(self) -> None:
        self.catch_up()

    def on_unmount(self) -> None:
        self.ready = False

    def catch_up(self) -> None:
        app = self.mesh_app
        snap = app.latest_snapshot
        if snap is not None:
            self.set_reactive(NodeScreen.snapshot, snap)  # drawn here, not by the watcher
        self.refresh_status()  # (after the line above: the status reads self.snapshot)
        if snap is not None:
            self.show_snapshot(snap)
        self.show_feed(app.feed)

    def refresh_status(self) -> None:
        app = self.mesh_app
        self.query_one(StatusBar).show(self.snapshot or app.latest_snapshot, app.node_state, app.node_detail)

    def watch_snapshot(self, snap: NodeSnapshot | None) -> None:
        if snap is None or not self.ready:
            return
        try:
            self.refresh_status()
            self.show_snapshot(snap)
        except NoMatches:
            # A screen switch is taking this screen's widgets down while the app hands it
            # a snapshot (seen in a CI run): the screen shown next draws it in catch_up.
            return

    # -- for subclasses -------------------------------------------------------------

    def show_snapshot(self, snap: NodeSnapshot) -> None:
        """Draw ``snap``; called only when it differs from the previous one."""

    def show_feed(self, feed: EventFeed) -> None:
        """Draw feed entries newer than those already drawn."""
