"""SVG snapshot tests of every screen at 80x24 and 120x40 with FakeNode data.

Time is frozen (``clock``, UTC), the prompt cursor does not blink, and each shot waits
until the scripted events have been drawn, so the output is deterministic.
Update after an intended change with ``pytest tests/test_ui_snapshots.py --snapshot-update``
and review the SVGs under tests/__snapshots__/.
"""

from __future__ import annotations

import datetime as dt

import pytest

from tests.fake_node import NOW, FakeNode
from ui.app import SCREENS, make_app

SIZES = [(80, 24), (120, 40)]


def _app():
    node = FakeNode()
    return node, make_app(node, clock=lambda: NOW, tz=dt.timezone.utc, cursor_blink=False)


def _settled(app, n_events: int):
    async def run_before(pilot) -> None:
        while app.feed.events_seen < n_events:
            await pilot.pause(0.02)
        await pilot.pause(0.4)  # > one refresh period: the feed and the snapshot are drawn
        await pilot.wait_for_scheduled_animations()

    return run_before


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("key, mode", [(str(i), mode) for i, (mode, _, _) in enumerate(SCREENS, start=1)])
def test_screen_snapshot(snap_compare, key, mode, size):
    node, app = _app()
    assert snap_compare(app, press=[key], terminal_size=size, run_before=_settled(app, len(node.scripted)))


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_help_snapshot(snap_compare, size):
    node, app = _app()
    assert snap_compare(app, press=["question_mark"], terminal_size=size,
                        run_before=_settled(app, len(node.scripted)))
