"""Pilot tests of the TUI against FakeNode (and a real local HTTP server for Chat)."""

from __future__ import annotations

import asyncio
import io
import datetime as dt
import json
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from rich.console import Console
from textual.widgets import DataTable, Input, RichLog, Static

from meshnode.state import PeerInfo, compute_label
from tests.fake_node import NOW, FakeNode
from ui.app import SCREENS, MeshnodeApp, make_app
from ui.screens.chat import ChatMessage, ChatScreen
from ui.screens.help import HelpScreen
from ui.screens.logs import LogsScreen
from ui.widgets import StatusBar
from ui.widgets.stage_map import StageMap

ROOT = Path(__file__).resolve().parents[1]


def new_app(node: FakeNode | None = None, **kwargs) -> MeshnodeApp:
    kwargs.setdefault("clock", lambda: NOW)
    kwargs.setdefault("tz", dt.timezone.utc)
    kwargs.setdefault("cursor_blink", False)
    return make_app(node or FakeNode(), **kwargs)


async def wait_for(pilot, predicate, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.02)


def log_lines(log: RichLog) -> list[str]:
    return [strip.text.rstrip() for strip in log.lines]


# -- navigation ---------------------------------------------------------------------


async def test_number_keys_switch_screens():
    app = new_app()
    async with app.run_test(size=(80, 24)) as pilot:
        for i, (_, _, cls) in enumerate(SCREENS, start=1):
            if isinstance(app.screen, ChatScreen):
                await pilot.press("escape")  # leave the prompt so digits aren't typed
            await pilot.press(str(i))
            assert type(app.screen) is cls
        await pilot.press("1")
        assert type(app.screen) is SCREENS[0][2]


async def test_chat_prompt_keeps_digits_and_function_keys_still_switch():
    app = new_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("6")
        assert isinstance(app.screen, ChatScreen)
        await pilot.press("1", "q", "question_mark")
        assert isinstance(app.screen, ChatScreen)
        assert app.screen.query_one("#prompt", Input).value == "1q?"
        await pilot.press("f4")
        assert type(app.screen) is SCREENS[3][2]


async def test_help_lists_every_binding():
    app = new_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        console = Console(width=100, file=io.StringIO(), record=True)
        console.print(app.screen.query_one("#help-box Static", Static).content)
        text = console.export_text()
        for _, title, cls in SCREENS:
            assert f"Show the {title} screen" in text
            for b in cls.__dict__.get("BINDINGS", ()):
                assert (b.tooltip or b.description) in text
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_quit_key_exits():
    app = new_app()
    async with app.run_test() as pilot:
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0


# -- data on screens ----------------------------------------------------------------


async def test_drafts_view_tells_accepted_from_rejected():
    node = FakeNode()
    app = new_app(node)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("3")
        await wait_for(pilot, lambda: len(app.screen.query_one("#drafts", RichLog).lines) >= 5)
        log = app.screen.query_one("#drafts", RichLog)
        lines = log_lines(log)
        # text markers: readable without colour
        assert "2/4 ✓[    if][ n] ✗[ <][ 2] →[ <=]" in lines[1]
        assert "0/4 ✗[(n][ -][ 1][)] →[ib]" in lines[4]
        assert "✗" not in lines[0] and "✓" not in lines[4]
        # and colour / strike-through when colour is available
        segments = {seg.text: seg.style for seg in log.lines[1]}
        assert segments["[ <]"].strike and segments["[ <]"].color.name == "red"
        assert segments["[ n]"].color.name == "green" and not segments["[ n]"].strike


async def test_requests_table_shows_snapshot_numbers():
    app = new_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("4")
        table = app.screen.query_one("#requests", DataTable)
        await wait_for(pilot, lambda: table.row_count == 5)
        row = [str(c) for c in table.get_row("req-0007")]
        assert row[:8] == ["req-0007", "decoding", "412", "87", "51.3", "184 ms", "10.0s", "ngram"]
        done = [str(c) for c in table.get_row("req-0005")]
        assert done[1:7] == ["done", "96", "256", "63.8", "142 ms", "4.2s"]


async def test_snapshot_changes_show_up_and_keep_cursor():
    node = FakeNode()
    app = new_app(node)
    async with app.run_test(size=(80, 24)) as pilot:
        table = app.screen.query_one("#nodes", DataTable)
        await wait_for(pilot, lambda: table.row_count == 4)
        table.move_cursor(row=2)
        snap = node.snapshot()
        echo = PeerInfo("n-echo", "echo", "192.168.1.14:7400", 3.2, True, lane=True)
        node.set_snapshot(replace(snap, peers=(*snap.peers, echo)))
        await wait_for(pilot, lambda: table.row_count == 5)
        assert str(table.get_row("n-echo")[0]) == "echo"
        assert str(table.get_row("n-echo")[5]) == "✓ yes · lane"
        assert str(table.get_row("n-bravo")[5]) == "✓ yes"
        assert table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value == "n-charlie"


async def test_nodes_that_share_a_name_are_told_apart_in_the_table_and_the_stage_map():
    # bravo kept the hostname alpha has: each shows with the start of its id
    node = FakeNode()
    snap = node.snapshot()
    peers = tuple(replace(p, name="alpha") if p.node_id == "n-bravo" else p for p in snap.peers)
    stages = tuple(replace(s, node_name="alpha") if s.node_id == "n-bravo" else s for s in snap.stages)
    node.set_snapshot(replace(snap, peers=peers, stages=stages))
    app = new_app(node)
    async with app.run_test(size=(120, 30)) as pilot:
        table = app.screen.query_one("#nodes", DataTable)
        await wait_for(pilot, lambda: table.row_count == 4)
        await wait_for(pilot, lambda: str(table.get_row("n-bravo")[0]) == "alpha#n-brav")
        assert str(table.get_row("n-alpha")[0]) == "alpha#n-alph *"
        assert str(table.get_row("n-charlie")[0]) == "charlie"
        legend = str(app.screen.query_one(StageMap).render())
        assert "alpha#n-alph" in legend and "alpha#n-brav" in legend and "charlie" in legend


def test_compute_label_names_the_threads_only_where_they_are_known():
    assert compute_label("cpu", 2, 2) == "cpu, 2 threads"
    assert compute_label("cpu", 1, 4) == "cpu, 1 of 4 threads"
    assert compute_label("cpu", 1, 1) == "cpu, 1 thread"
    assert compute_label("cuda") == "cuda" and compute_label("cpu", 0, 2) == "cpu"
    assert compute_label("", 2, 2) == ""


async def test_the_stage_map_says_what_each_stage_computes_on():
    # stage 0 adapted to a busy machine (1 of its 2 threads); a peer's stage: its backend only
    node = FakeNode()
    snap = node.snapshot()
    stages = (replace(snap.stages[0], backend="cpu", threads=1, max_threads=2),
              replace(snap.stages[1], backend="cuda"), *snap.stages[2:])
    node.set_snapshot(replace(snap, stages=stages))
    app = new_app(node)
    async with app.run_test(size=(120, 30)) as pilot:
        stage_map = app.screen.query_one(StageMap)
        await wait_for(pilot, lambda: "1 of 2" in str(stage_map.render()))
        legend = str(stage_map.render()).splitlines()
        assert any("S0" in line and "on cpu, 1 of 2 threads" in line for line in legend), legend
        assert any("S1" in line and "on cuda" in line and "thread" not in line for line in legend), legend


async def test_logs_filter_by_level():
    app = new_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("7")
        assert isinstance(app.screen, LogsScreen)
        log = app.screen.query_one("#log", RichLog)
        await wait_for(pilot, lambda: len(log.lines) == 6)
        await pilot.press("e")
        await wait_for(pilot, lambda: len(log.lines) == 1)
        assert "ERROR meshnode.serve: request req-0004 failed" in log_lines(log)[0]
        await pilot.press("w")
        await wait_for(pilot, lambda: len(log.lines) == 2)
        await pilot.press("l")  # cycles warning -> error
        await wait_for(pilot, lambda: len(log.lines) == 1)
        await pilot.press("d")
        await wait_for(pilot, lambda: len(log.lines) == 6)


class CountingNode(FakeNode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def snapshot(self):
        self.calls += 1
        return super().snapshot()


@pytest.mark.parametrize("hz, most", [(4, 8), (1000, 16)])
async def test_snapshot_polling_is_bounded(hz, most):
    node = CountingNode()
    app = new_app(node, refresh_hz=hz)
    async with app.run_test() as pilot:
        node.calls = 0
        await pilot.pause(1.0)
    assert 1 <= node.calls <= most  # 4 Hz asked; 10 Hz is the ceiling


# -- node lifecycle (run_tui's path) -------------------------------------------------


async def test_managed_node_is_started_and_stopped():
    node = FakeNode()
    app = MeshnodeApp(node, manage_node=True, cursor_blink=False)
    async with app.run_test() as pilot:
        await wait_for(pilot, lambda: app.node_state == "running")
        assert node.started and not node.stopped
        await pilot.press("q")
        await pilot.pause()
    assert node.stopped and app.return_code == 0


class FailingNode(FakeNode):
    async def start(self) -> None:
        raise OSError("port 7400 in use")


async def test_node_that_fails_to_start_is_reported_not_raised():
    app = MeshnodeApp(FailingNode(), manage_node=True, cursor_blink=False)
    async with app.run_test(size=(100, 24)) as pilot:
        await wait_for(pilot, lambda: app.node_state == "failed")
        await pilot.pause(0.1)
        right = str(app.screen.query_one(StatusBar).query_one("#status-right").render())
        assert "failed" in right and "port 7400 in use" in right
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 1


# -- chat against a real HTTP server ---------------------------------------------------


def _chunk(text: str | None = None, finish: str | None = None) -> str:
    delta = {"content": text} if text is not None else {}
    obj = {"id": "c1", "object": "chat.completion.chunk", "model": "m",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(obj)}\n\n"


async def _chat_completions(request: Request):
    body = await request.json()
    prompt = body["messages"][-1]["content"]
    request.app.state.bodies.append(body)
    if prompt == "bad request":
        return JSONResponse({"error": {"message": "context overflow: 9000 > 8192 tokens",
                                       "type": "invalid_request_error", "code": "context_length_exceeded"}},
                            status_code=400)

    async def sse() -> AsyncIterator[str]:
        yield ": keep-alive\n\n"
        for piece in ("Hello", ", ", "mesh", "!"):
            yield _chunk(piece)
            await asyncio.sleep(0.01)
        if prompt == "fail midway":
            yield f"data: {json.dumps({'error': {'message': 'stage 2 lost', 'code': 503}})}\n\n"
        else:
            yield _chunk(finish="stop")
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream")


@pytest.fixture
async def openai_server() -> AsyncIterator[tuple[str, Starlette]]:
    api = Starlette(routes=[Route("/v1/chat/completions", _chat_completions, methods=["POST"])])
    api.state.bodies = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(api, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api
    server.should_exit = True
    await task
    sock.close()


async def _ask(pilot, app, prompt: str) -> ChatMessage:
    inp = app.screen.query_one("#prompt", Input)
    inp.value = prompt
    await pilot.press("enter")
    await wait_for(pilot, lambda: not app.screen.streaming and list(app.screen.query(ChatMessage)))
    return list(app.screen.query(ChatMessage))[-1]


async def test_chat_streams_the_answer(openai_server):
    url, api = openai_server
    app = new_app(FakeNode(http_url=url))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("6")
        answer = await _ask(pilot, app, "hi there")
        assert answer.text == "Hello, mesh!" and answer.error is None
        assert "Hello, mesh!" in str(answer.render())
        body = api.state.bodies[-1]
        assert body["stream"] is True and body["model"] == FakeNode().snapshot().model
        assert "temperature" not in body  # the endpoint's default unless the app sets one
        # second turn carries the conversation
        await _ask(pilot, app, "again")
        assert [m["role"] for m in api.state.bodies[-1]["messages"]] == ["user", "assistant", "user"]


async def test_chat_asks_any_model_of_the_mesh(openai_server):
    url, api = openai_server
    snap = FakeNode().snapshot()
    app = new_app(FakeNode(http_url=url))
    async with app.run_test(size=(100, 24)) as pilot:
        await pilot.press("6")
        line = str(app.screen.query_one("#chat-model").render())
        assert snap.model in line and "Ctrl+O" in line
        await pilot.press("ctrl+o")   # the peer's model: the request names it
        line = str(app.screen.query_one("#chat-model").render())
        assert "gemma-3-270m-q4_k_m on charlie" in line
        await _ask(pilot, app, "hi there")
        assert api.state.bodies[-1]["model"] == "gemma-3-270m-q4_k_m"
        await pilot.press("ctrl+o")   # and round again to this node's
        await _ask(pilot, app, "again")
        assert api.state.bodies[-1]["model"] == snap.model


async def test_chat_sends_the_apps_temperature(openai_server):
    url, api = openai_server
    app = new_app(FakeNode(http_url=url), chat_temperature=0.0)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("6")
        await _ask(pilot, app, "hi there")
        assert api.state.bodies[-1]["temperature"] == 0.0


async def test_chat_shows_openai_errors_inline(openai_server):
    url, _ = openai_server
    app = new_app(FakeNode(http_url=url))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("6")
        answer = await _ask(pilot, app, "bad request")
        assert answer.error == "HTTP 400: context overflow: 9000 > 8192 tokens"
        assert "✗ error: HTTP 400: context overflow" in str(answer.render())
        answer = await _ask(pilot, app, "fail midway")
        assert answer.text == "Hello, mesh!" and answer.error == "stage 2 lost"
        assert app.screen.history == []  # failed turns are not replayed to the model


async def test_chat_reports_unreachable_endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    app = new_app(FakeNode(http_url=f"http://127.0.0.1:{port}/v1"))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("6")
        answer = await _ask(pilot, app, "hello?")
        assert answer.error and answer.error.startswith("cannot reach http://127.0.0.1:")


# -- the seam -------------------------------------------------------------------------


@pytest.mark.slow
def test_meshnode_never_imports_textual_or_ui():
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys, json
        import meshnode
        failed = {}
        for mod in pkgutil.walk_packages(meshnode.__path__, "meshnode."):
            if mod.name.endswith("__main__"):
                continue
            try:
                importlib.import_module(mod.name)
            except Exception as exc:  # collected, so that one run names every broken module
                failed[mod.name] = repr(exc)
        bad = sorted(m for m in sys.modules
                     if m.split(".")[0] in ("textual", "textual_plotext", "ui", "plotext"))
        print(json.dumps({"bad": bad, "failed": failed,
                          "imported": sorted(m for m in sys.modules if m.startswith("meshnode"))}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # A module that does not import is a failure, not a skip: the rule cannot be checked
    # on it, and the product is broken.
    assert result["failed"] == {}, "meshnode modules that fail to import:\n" + "\n".join(
        f"  {name}: {error}" for name, error in sorted(result["failed"].items()))
    assert result["bad"] == [], f"meshnode imported {result['bad']}"
    assert "meshnode.state" in result["imported"] and "meshnode.cli" in result["imported"]


async def test_every_screen_copes_with_an_empty_node():
    """A node just started: no model, peers, requests, telemetry or transfers."""
    full = FakeNode().snapshot()
    empty = replace(full, peers=(), model=None, model_layers=0, stages=(), requests=(), spec=(),
                    telemetry=(), models=(), transfers=(), mesh_models=())
    app = new_app(FakeNode(snapshot=empty, events=[]))
    async with app.run_test(size=(80, 24)) as pilot:
        for i, (_, _, cls) in enumerate(SCREENS, start=1):
            if isinstance(app.screen, ChatScreen):
                await pilot.press("escape")
            await pilot.press(str(i))
            await pilot.pause(0.05)
            assert type(app.screen) is cls
        await pilot.press("6")
        answer = await _ask(pilot, app, "hello")
        assert answer.error == "no model is ready in the mesh yet (see the Mesh screen)"


# -- the model service's start-up in the status bar and on Mesh ------------------------


def _status_snap(status: str, detail: str = "", **changes):
    from meshnode.state import ModelStatus, TransferInfo

    base = FakeNode().snapshot()
    changes.setdefault("transfers", (TransferInfo("default model", 45, 100, "extract"),))
    return replace(base, status=ModelStatus(status), status_detail=detail, **changes)


@pytest.mark.parametrize("status, detail, bar, mesh", [
    ("fetching", "default model", "◌ fetching default model · extract 45%",
     "◌ model: fetching default model · extract 45%"),
    ("waiting for peers", "plan needs 2 nodes, mesh has 1", "◌ waiting for peers · plan needs 2 nodes, mesh has 1",
     "◌ model: waiting for peers · plan needs 2 nodes, mesh has 1"),
    ("planning", "", "◌ planning · 2/3 stages ready", "◌ model: planning · 2/3 stages ready"),
    ("failed", "no such model: x.gguf", "✗ model failed: no such model: x.gguf", "✗ model: failed: no such model: x.gguf"),
    ("no model", "", "○ no model (lending memory)", "○ model: no model (lending memory)"),
    ("ready", "3 stage(s)", "● ready · 3 stage(s)", None),
])
async def test_model_service_state_is_shown(status, detail, bar, mesh):
    app = new_app(FakeNode(snapshot=_status_snap(status, detail), events=[]))
    async with app.run_test(size=(120, 30)) as pilot:
        await pilot.pause(0.1)
        right = str(app.screen.query_one(StatusBar).query_one("#status-right").render())
        assert right.strip() == bar
        service = app.screen.query_one("#service-status", Static)
        assert service.display == (mesh is not None)
        if mesh is not None:
            assert str(service.render()) == mesh


# -- 80 columns, NO_COLOR, a node whose snapshot always changes ----------------------------


async def test_tables_fit_80_columns():
    app = new_app()
    async with app.run_test(size=(80, 24)) as pilot:
        for i, (mode, _, _) in enumerate(SCREENS, start=1):
            if isinstance(app.screen, ChatScreen):
                await pilot.press("escape")
            await pilot.press(str(i))
            await pilot.pause(0.1)
            for table in app.screen.query(DataTable):
                assert table.virtual_size.width <= table.scrollable_content_region.width, (mode, table.id)


def test_sparkline_draws_one_column_per_sample_from_zero():
    from ui.widgets.metric import spark_text

    assert spark_text([14.5], 10) == "█"          # one sample is one bar, not a full row
    assert spark_text([0.0, 0.0], 10) == "▁▁"     # a constant 0 is low, not full
    assert spark_text([1, 2, 4, 8], 3) == "▃▅█"   # newest at the right, scaled 0..max
    assert spark_text([], 5) == ""


async def test_no_color_keeps_every_foreground_readable(monkeypatch):
    from rich.style import Style
    from textual.color import Color

    from ui.nocolor import ReadableMonochrome, readable_monochrome_style

    monkeypatch.setenv("NO_COLOR", "1")
    app = new_app()
    assert any(isinstance(f, ReadableMonochrome) for f in app._filters)
    for fg in ("#ff0000", "#0000ff", "#00aa00", "#555555"):
        style = readable_monochrome_style(Style.parse(f"{fg} strike on #121212"))
        assert style.strike
        assert abs(Color.from_rich_color(style.color).brightness
                   - Color.from_rich_color(style.bgcolor).brightness) >= 0.3


class ChangingNode(FakeNode):
    """Like a real node: every snapshot differs from the last (the token count grows)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def snapshot(self):
        self.n += 1
        snap = super().snapshot()
        req = replace(snap.requests[0], generated_tokens=self.n)
        return replace(snap, requests=(req, *snap.requests[1:]))


async def test_switching_screens_while_snapshots_change():
    """A snapshot handed to a screen before its on_mount ran (columns not added yet)
    used to crash the app with 'More values provided than there are columns'."""
    node = ChangingNode()
    app = new_app(node, refresh_hz=10)
    async with app.run_test(size=(80, 24)) as pilot:
        for _ in range(3):
            for key in ("f2", "f3", "f4", "f5", "f7", "f1"):
                await pilot.press(key)
                await pilot.pause(0.02)
        await pilot.press("f4")
        table = app.screen.query_one("#requests", DataTable)
        await wait_for(pilot, lambda: table.row_count == 5)
        n = int(str(table.get_row("req-0007")[3]))
        await pilot.pause(0.3)
        assert int(str(table.get_row("req-0007")[3])) > n
