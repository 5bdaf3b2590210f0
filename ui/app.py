"""The meshnode TUI: one Textual app over the node's public API.

Theory of operation. The app never reaches into the node: it reads
``node.snapshot()`` on a timer (``refresh_hz``, at most 10 Hz) and hands the snapshot to
the active screen, which draws only when it changed; one worker consumes
``node.events()`` into an :class:`~ui.feed.EventFeed` and posts :class:`EventsArrived`
messages, which coalesce in the queue and are drawn at most ``refresh_hz`` times per
second. The only outbound traffic is the Chat screen's HTTP request to the node's own
OpenAI endpoint.

``run_tui(make_node)`` is the product entry point: it runs the node and the app in one
asyncio loop. The node is started from a worker once the UI is up (so model downloads
show as progress in the status bar and on the Mesh screen) and stopped when the app
quits. ``make_app(node)`` builds the app over a node that is already running (tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.filter import Monochrome
from textual.message import Message
from textual.timer import Timer

from meshnode.state import NodeAPI, NodeSnapshot
from ui.feed import EventFeed
from ui.nocolor import ReadableMonochrome
from ui.screens.base import NodeScreen
from ui.screens.chat import ChatScreen
from ui.screens.help import HelpScreen
from ui.screens.logs import LogsScreen
from ui.screens.mesh import MeshScreen
from ui.screens.models import ModelsScreen
from ui.screens.requests import RequestsScreen
from ui.screens.speculation import SpeculationScreen
from ui.screens.telemetry import TelemetryScreen

log = logging.getLogger("meshnode.ui")

# (mode name, title, screen class); the number key of each is its position + 1.
SCREENS: tuple[tuple[str, str, type[NodeScreen]], ...] = (
    ("mesh", "Mesh", MeshScreen),
    ("telemetry", "Telemetry", TelemetryScreen),
    ("speculation", "Speculation", SpeculationScreen),
    ("requests", "Requests", RequestsScreen),
    ("models", "Models", ModelsScreen),
    ("chat", "Chat", ChatScreen),
    ("logs", "Logs", LogsScreen),
)

# short footer labels, so every key fits 80 columns
_SHORT = {"Telemetry": "Telem", "Speculation": "Spec", "Requests": "Reqs"}

MAX_REFRESH_HZ = 10.0


class ManagedNode(NodeAPI, Protocol):
    """A node the TUI starts and stops itself (``meshnode.node.Node``)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class EventsArrived(Message):
    """New entries in the app's EventFeed; queued copies replace each other."""

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, EventsArrived)


class MeshnodeApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "meshnode"
    ENABLE_COMMAND_PALETTE = False
    MODES = {mode: cls for mode, _, cls in SCREENS}
    DEFAULT_MODE = "mesh"
    BINDINGS = [
        *(
            Binding(str(i), f"switch_mode('{mode}')", _SHORT.get(title, title), tooltip=f"Show the {title} screen")
            for i, (mode, title, _) in enumerate(SCREENS, start=1)
        ),
        # F1..F7 also switch screens, and work while the Chat prompt has focus.
        *(
            Binding(f"f{i}", f"switch_mode('{mode}')", title, show=False, priority=True)
            for i, (mode, title, _) in enumerate(SCREENS, start=1)
        ),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(
        self,
        node: NodeAPI,
        *,
        refresh_hz: float = 4.0,
        manage_node: bool = False,
        clock: Callable[[], float] = time.time,
        tz: _dt.tzinfo | None = None,
        cursor_blink: bool = True,
        chat_temperature: float | None = None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        """``manage_node``: start the node on mount and stop it on quit (``run_tui``);
        ``on_started`` is called once the node it manages is up.

        ``chat_temperature``: the sampling temperature the Chat screen asks for (None:
        the endpoint's default; 0 makes answers greedy and repeatable, as tests need).

        ``clock`` (unix time) and ``tz`` (None: local) drive every time shown, and
        ``cursor_blink`` the prompt's cursor, so tests can freeze them.
        """
        super().__init__()
        if self.no_color:  # NO_COLOR: greys, but never dark grey on black (ui/nocolor.py)
            self._filters = [ReadableMonochrome() if type(f) is Monochrome else f for f in self._filters]
        self.node = node
        self.refresh_hz = min(max(refresh_hz, 0.1), MAX_REFRESH_HZ)
        self.manage_node = manage_node
        self.clock = clock
        self.tz = tz
        self.cursor_blink = cursor_blink
        self.chat_temperature = chat_temperature
        self.on_started = on_started
        self.feed = EventFeed()
        self.latest_snapshot: NodeSnapshot | None = None
        self.node_state = "starting" if manage_node else "running"
        self.node_detail = ""
        self._stopping: asyncio.Future | None = None
        self._flush_timer: Timer | None = None
        self._last_flush = 0.0
        self._subscribed = False

    # -- lifecycle ------------------------------------------------------------------

    def on_mount(self) -> None:
        self.poll()
        self.set_interval(1 / self.refresh_hz, self.poll, name="snapshot-poll")
        self.consume_events()
        if self.manage_node:
            self.start_node()

    @work(exclusive=True, group="node-lifecycle", exit_on_error=False)
    async def start_node(self) -> None:
        node: ManagedNode = self.node  # type: ignore[assignment]
        try:
            await node.start()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # shown to the user; the app stays up to show logs
            log.exception("node failed to start")
            self.set_node_state("failed", f"{type(exc).__name__}: {exc}")
            self.notify(f"The node failed to start: {exc}", severity="error", timeout=30)
            return
        self.set_node_state("running")
        if self.on_started is not None:
            self.on_started()
        if not self._subscribed:
            self.consume_events()
        self.poll()

    async def stop_node(self) -> None:
        """Stop a managed node once; a no-op for nodes the app didn't start. A second
        call (q during a signal's stop) waits for the first to finish."""
        if not self.manage_node:
            return
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop_node())
        await asyncio.shield(self._stopping)

    async def _stop_node(self) -> None:
        self.workers.cancel_group(self, "node-lifecycle")
        self.set_node_state("stopping")
        try:
            await self.node.stop()  # type: ignore[attr-defined]
        except Exception:
            log.exception("node failed to stop cleanly")

    async def action_quit(self) -> None:
        code = 1 if self.node_state == "failed" else 0
        await self.stop_node()
        self.exit(return_code=code)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    @property
    def node_screen(self) -> NodeScreen | None:
        """The visible screen if it shows node state. None while a screen switch has the
        stack momentarily empty (timers keep firing then)."""
        stack = self.screen_stack
        top = stack[-1] if stack else None
        return top if isinstance(top, NodeScreen) else None

    def set_node_state(self, state: str, detail: str = "") -> None:
        self.node_state, self.node_detail = state, detail
        screen = self.node_screen if self.is_running else None
        if screen is not None and screen.ready:
            screen.refresh_status()

    # -- node -> UI -----------------------------------------------------------------

    def poll(self) -> None:
        """Read one snapshot and give it to the active screen if it changed."""
        try:
            snap = self.node.snapshot()
        except Exception as exc:  # a node still starting may not have state yet
            if self.node_state == "running":
                log.debug("snapshot failed: %s", exc)
            return
        if snap is self.latest_snapshot or snap == self.latest_snapshot:
            return
        self.latest_snapshot = snap
        screen = self.node_screen
        if screen is not None:
            screen.snapshot = snap

    @work(exclusive=True, group="node-events", exit_on_error=False)
    async def consume_events(self) -> None:
        try:
            events = self.node.events()
            self._subscribed = True
            async for event in events:
                self.feed.add(event)
                self.post_message(EventsArrived())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._subscribed = False
            if self.node_state == "running":
                log.warning("event stream ended: %s", exc)

    def on_events_arrived(self, _: EventsArrived) -> None:
        if self._flush_timer is not None:
            return  # a draw is already scheduled
        # (a Timer needs a positive delay)
        delay = max(0.01, self._last_flush + 1 / self.refresh_hz - time.monotonic())
        self._flush_timer = self.set_timer(delay, self._flush_feed, name="feed-flush")

    def _flush_feed(self) -> None:
        self._flush_timer = None
        self._last_flush = time.monotonic()
        screen = self.node_screen
        if screen is not None and screen.ready:
            screen.show_feed(self.feed)


def make_app(node: NodeAPI, **kwargs) -> MeshnodeApp:
    """The TUI over an already running ``node``; keyword arguments go to MeshnodeApp."""
    return MeshnodeApp(node, **kwargs)


@contextlib.contextmanager
def _terminal_logging_muted() -> Iterator[None]:
    """Detach root log handlers that write to the terminal while the TUI owns it."""
    root = logging.getLogger()
    muted = [
        h for h in root.handlers
        if isinstance(h, logging.StreamHandler)
        and getattr(h, "stream", None) in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    ]
    for h in muted:
        root.removeHandler(h)
    try:
        yield
    finally:
        for h in muted:
            root.addHandler(h)


def _terminal_state() -> list | None:
    """The terminal's settings before the TUI changes them (None without a terminal)."""
    try:
        import termios

        return termios.tcgetattr(sys.__stdin__.fileno())
    except Exception:  # noqa: BLE001 - no terminal, or not a POSIX one
        return None


def _restore_terminal(saved: list | None) -> None:
    """Best effort before an immediate exit: leave the alternate screen, show the cursor
    and give the shell back its line mode (the TUI's own cleanup will not run)."""
    with contextlib.suppress(Exception):
        sys.__stdout__.write("\x1b[?1049l\x1b[?25h")
        sys.__stdout__.flush()
    if saved is not None:
        with contextlib.suppress(Exception):
            import termios

            termios.tcsetattr(sys.__stdin__.fileno(), termios.TCSANOW, saved)


def run_tui(make_node: Callable[[], ManagedNode], *, refresh_hz: float = 4.0,
            loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
            on_started: Callable[[], None] | None = None) -> int:
    """Run the node and the TUI in one asyncio loop until the user quits.

    ``make_node`` is called inside the loop (so the node may bind loop resources in its
    constructor); the node is started once the UI is up and stopped when it closes,
    however it closes (q, SIGINT or SIGTERM; a second signal exits at once with 128 + its
    number). Returns the process exit code (1 when the node failed to start).
    ``loop_factory``: the node's event loop (e.g. busy polling), as for :class:`asyncio.Runner`;
    ``on_started``: called once the node is up.
    """

    async def main() -> int:
        node = make_node()
        app = MeshnodeApp(node, refresh_hz=refresh_hz, manage_node=True, on_started=on_started)
        signalled: list[int] = []
        quitting: list[asyncio.Future] = []
        terminal = _terminal_state()

        def on_signal(sig: signal.Signals) -> None:
            # SIGTERM (or SIGINT sent from outside: in the TUI Ctrl-C is a key) quits
            # as q does: the node drains and stops. A second one exits at once.
            if signalled:
                _restore_terminal(terminal)
                print(f"meshnode: {sig.name} again: exiting without waiting", file=sys.stderr, flush=True)
                os._exit(128 + sig)
            signalled.append(sig)
            log.info("%s: stopping (%s again exits at once)", sig.name, sig.name)
            quitting.append(asyncio.ensure_future(app.action_quit()))   # held: not collected

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            await app.run_async()
        finally:
            await app.stop_node()
        code = app.return_code
        return 1 if code is None and app.node_state == "failed" else int(code or 0)

    with _terminal_logging_muted(), asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main())
