"""The TUI against a real node serving the real default model (SmolLM2-135M).

Pilot drives the app as a user would: it waits for the model service to become ready
(watching the status bar go through fetching ... ready), switches screens with keys,
types a prompt into Chat and presses Enter, then checks that the Requests, Telemetry
and Speculation screens display exactly what ``node.snapshot()`` reports. A last test
runs the ``meshnode`` command itself in a tmux terminal and quits it with ``q``.

Slow (a model download from ``$MESHNODE_MODEL_SOURCE_DIR``, a load and a generation
on one thread): marked ``slow``.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from textual.widgets import DataTable, Input, RichLog

from meshnode.node import Node
from meshnode.paths import NodePaths
from meshnode.serve.service import ServiceOptions
from meshnode.spec.strategy import CliSpecOptions
from meshnode.state import SpecState
from ui.app import SCREENS, MeshnodeApp
from ui.format import fmt_ahead, fmt_ms, short_id
from ui.screens.chat import ChatMessage, ChatScreen
from ui.screens.mesh import MeshScreen
from ui.screens.requests import RequestsScreen
from ui.screens.speculation import SpeculationScreen
from ui.screens.telemetry import TelemetryScreen
from ui.widgets import MetricRow, StatusBar

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# Repetitive on purpose: the n-gram proposer finds its drafts in the prompt. The chat is
# greedy (chat_temperature=0), so the answer does not depend on a random seed; SmolLM2
# repeats this list until the context runs out (73 of 73 drafts accepted here).
PROMPT = "Repeat this list: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry"


def make_node(home: Path, model: str | None = None) -> Node:
    """A node like `meshnode run --port 0 --threads 1` builds (cli/run.py `_node_kwargs`),
    loopback only, with n-gram speculation forced on so drafts happen in a short answer."""
    service = ServiceOptions(
        model=model, n_ctx=256, n_batch=64, parallel=1, threads=1, wait_peers=0.0,
        spec_cli=CliSpecOptions(strategy="ngram", mode="on"),
    )
    return Node(NodePaths.resolve(home), port=0, http_port=0, interfaces=["127.0.0.1"],
                discovery=False, service=service, threads=1)


async def wait_for(pilot, predicate, timeout: float, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not met in {timeout:.0f} s")
        await pilot.pause(0.05)


def status_right(app: MeshnodeApp) -> str:
    return str(app.screen.query_one(StatusBar).query_one("#status-right").render())


def status_left(app: MeshnodeApp) -> str:
    return str(app.screen.query_one(StatusBar).query_one("#status-left").render())


def cells(table: DataTable, key: str) -> list[str]:
    return [str(c) for c in table.get_row(key)]


async def test_real_node_screens_show_what_the_node_reports(tmp_path: Path, model_source_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MESHNODE_MODEL_SOURCE_DIR", str(model_source_dir))
    node = make_node(tmp_path / "home")  # model=None: the default model, fetched on start
    app = MeshnodeApp(node, manage_node=True, cursor_blink=False, chat_temperature=0.0)
    async with app.run_test(size=(120, 40)) as pilot:
        # -- start-up: the status bar follows the model service ------------------------
        seen: list[str] = []

        def ready() -> bool:
            text = status_right(app)
            if not seen or seen[-1] != text:
                seen.append(text)
            snap = app.latest_snapshot
            return snap is not None and snap.status == "ready" and "● ready" in text

        await wait_for(pilot, ready, 240, "model ready")
        assert any(s.startswith("◌ starting") for s in seen), seen
        fetching = [s for s in seen if s.startswith("◌ fetching default model")]
        assert fetching, seen  # with the transfer's progress once it is known
        assert any("%" in s for s in fetching), fetching
        snap = node.snapshot()
        assert seen[-1].strip() == f"● ready · {snap.status_detail}"
        assert f"{snap.node.name} · {snap.model} · 0 peers" in status_left(app)
        mesh = app.screen
        assert isinstance(mesh, MeshScreen)
        await wait_for(pilot, lambda: "S0 [0,30)" in cells(mesh.query_one("#nodes", DataTable), snap.node.node_id),
                       5, "own role in the nodes table")
        assert not mesh.query_one("#service-status").display  # shown only until ready

        # -- keys switch screens ----------------------------------------------------------
        for i, (_, _, cls) in enumerate(SCREENS, start=1):
            if isinstance(app.screen, ChatScreen):
                await pilot.press("escape")  # leave the prompt, so digits switch screens
            await pilot.press(str(i))
            assert type(app.screen) is cls
        await pilot.press("f1")
        assert type(app.screen) is SCREENS[0][2]

        # -- a chat through the Chat screen ------------------------------------------------
        await pilot.press("6")
        chat = app.screen
        assert isinstance(chat, ChatScreen) and chat.query_one("#prompt", Input).has_focus
        await pilot.press(*("space" if c == " " else c for c in PROMPT))
        assert chat.query_one("#prompt", Input).value == PROMPT
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(chat.query(ChatMessage)) == 2, 5, "prompt sent")
        answer = list(chat.query(ChatMessage))[-1]
        await wait_for(pilot, lambda: not answer.pending, 240, "answer streamed")
        assert answer.role == "assistant" and answer.error is None and answer.text.strip()
        assert chat.history[-1] == {"role": "assistant", "content": answer.text}

        snap = node.snapshot()
        [req] = snap.requests
        assert req.status == "done" and req.generated_tokens > 0 and req.tokens_per_s > 0

        # -- Requests ------------------------------------------------------------------------
        await pilot.press("f4")
        assert isinstance(app.screen, RequestsScreen)
        table = app.screen.query_one("#requests", DataTable)
        await wait_for(pilot, lambda: table.row_count == 1, 5, "request row")
        # the screen shows the app's latest snapshot, which may predate the request's end
        await wait_for(pilot, lambda: cells(table, req.request_id)[1] == "done", 5, "request row done")
        row = cells(table, req.request_id)
        assert row[:6] == [short_id(req.request_id), "done", str(req.prompt_tokens),
                           str(req.generated_tokens), f"{req.tokens_per_s:.1f}", fmt_ms(req.ttft_ms)]
        assert row[7] == req.strategy == "ngram"
        assert f"0 active · 1 recent · {snap.model}" in str(app.screen.query_one("#requests-title").render())

        # -- Telemetry: the node samples itself once a second -----------------------------
        await pilot.press("f2")
        assert isinstance(app.screen, TelemetryScreen)

        def metric(key: str) -> str:
            return app.screen.query_one(f"#metric-{key}", MetricRow).value

        def shows_latest() -> bool:
            points = node.snapshot().telemetry
            return bool(points) and metric("tps") == f"{points[-1].tokens_per_s:.1f}" \
                and metric("ttft") == fmt_ms(points[-1].ttft_ms)

        # The node samples once a second: the chat's tokens land in the next sample.
        await wait_for(pilot, lambda: any(p.tokens_per_s > 0 for p in node.snapshot().telemetry),
                       5, "the chat's tokens were sampled")
        await wait_for(pilot, shows_latest, 5, "telemetry drawn")
        points = node.snapshot().telemetry
        assert points[-1].ttft_ms == req.ttft_ms  # the last request's time to first token
        assert metric("hop") == "-"  # one node: no hops

        # -- Speculation ------------------------------------------------------------------
        await pilot.press("f3")
        spec_screen = app.screen
        assert isinstance(spec_screen, SpeculationScreen)
        [spec] = node.snapshot().spec
        assert spec.windows > 0, "the repetitive prompt gives the n-gram proposer drafts"
        assert spec.strategy == "ngram" and spec.proposed >= spec.accepted
        stats = spec_screen.query_one("#spec-stats", DataTable)
        await wait_for(pilot, lambda: stats.row_count == 1, 5, "spec row")
        assert cells(stats, "ngram") == [
            "ngram", spec.state.value,
            str(spec.current_window) if spec.state is SpecState.ENABLED else "-",
            f"{100 * spec.acceptance:.0f}%", str(spec.proposed), str(spec.accepted), str(spec.windows),
            fmt_ms(spec.verify_ms) if spec.windows else "-",
            fmt_ahead(spec.lookahead_used, spec.lookahead),
        ]
        # under the table, what sized the windows: the learned step costs, the estimate
        costs = spec_screen.query_one("#spec-costs")
        await wait_for(pilot, lambda: "step cost" in str(costs.render()), 5, "step costs")
        [spec] = node.snapshot().spec
        assert spec.step_ms and spec.step_ms[0][0] == 0, spec.step_ms   # plain steps were measured
        assert str(costs.render()).startswith(f"ngram step cost by drafts: plain {spec.step_ms[0][1]:.1f}")
        # every verified window arrived as a DraftVerified event and is drawn
        assert app.feed.drafts.total == spec.windows
        drafts = spec_screen.query_one("#drafts", RichLog)
        await wait_for(pilot, lambda: len(drafts.lines) >= spec.windows, 5, "drafts drawn")
        assert f"{req.request_id[-8:]} ngram" in drafts.lines[0].text
        assert sum(ev.n_accepted for _, ev in app.feed.drafts.items) == spec.accepted
        assert sum(len(ev.proposed) for _, ev in app.feed.drafts.items) == spec.proposed
        recent = app.feed.acceptance()["ngram"][-8:]
        acc = spec_screen.query_one("#acc-ngram", MetricRow).value
        assert acc == f"{100 * sum(recent) / len(recent):.0f}% last {len(recent)}"

        # -- back on Mesh (shown before, during start-up): the status is today's ---------
        await pilot.press("f1")
        await pilot.pause(0.1)
        assert status_right(app).strip() == f"● ready · {snap.status_detail}"

        # -- q stops the node and quits -----------------------------------------------------
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0
    assert not node.paths.runtime_file.exists()


async def test_model_failure_is_shown_with_its_reason(tmp_path: Path):
    node = make_node(tmp_path / "home", model=str(tmp_path / "missing.gguf"))
    app = MeshnodeApp(node, manage_node=True, cursor_blink=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: node.snapshot().status == "failed", 60, "model failed")
        detail = node.snapshot().status_detail
        assert detail
        await wait_for(pilot, lambda: "✗ model failed" in status_right(app), 5, "status bar")
        service = app.screen.query_one("#service-status")
        assert service.display
        assert str(service.render()) == f"✗ model: failed: {detail}"
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0  # the node ran; only its model failed


# -- the real command in a real terminal --------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_meshnode_command_opens_the_tui_and_quits_on_q(tmp_path: Path, model_source_dir: Path):
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    # bare `meshnode` takes only the global options; the HTTP port comes from the config
    (home / "config" / "config.toml").write_text(f"[node]\nhttp_port = {_free_port()}\n")
    done = tmp_path / "exit-code"
    session = f"meshnode-test-{uuid.uuid4().hex[:8]}"
    env = {"MESHNODE_MODEL_SOURCE_DIR": str(model_source_dir), "MESHNODE_KEYRING": "file"}
    exports = " ".join(f"{k}={v}" for k, v in env.items())
    cmd = (f"cd {ROOT} && {exports} {sys.executable} -m meshnode --home {home}; "
           f"echo $? > {done}; sleep 30")
    _tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "24", cmd)
    try:
        deadline = time.monotonic() + 240
        screen = ""
        while "● ready" not in screen:
            assert time.monotonic() < deadline, f"TUI never showed ready:\n{screen}"
            assert not done.exists(), f"meshnode exited early:\n{screen}"
            time.sleep(0.5)
            screen = _tmux("capture-pane", "-p", "-t", session)
        lines = screen.splitlines()
        assert lines[0].startswith(" Mesh ") and "smollm2" in lines[0]
        assert "1 Mesh" in lines[-1] and "q Quit" in lines[-1]
        runtime = NodePaths.resolve(home).runtime_file
        assert runtime.exists()
        _tmux("send-keys", "-t", session, "q")
        deadline = time.monotonic() + 30
        while not done.exists() or not done.read_text().strip():
            assert time.monotonic() < deadline, "meshnode did not exit on q"
            time.sleep(0.2)
        assert done.read_text().strip() == "0"
        assert not runtime.exists()
        log = (NodePaths.resolve(home).state / "meshnode.log").read_text()
        assert "ready on 1 stage(s)" in log
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


# -- README screenshots from a real session -------------------------------------------------


async def save_readme_screenshots(out_dir: str, size: tuple[int, int] = (100, 30)) -> list[str]:
    """Start a real node (default model) in a temporary home, chat once, then save the
    Chat, Mesh and Speculation screens as SVG into ``out_dir``."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        node = make_node(Path(tmp) / "home")
        app = MeshnodeApp(node, manage_node=True, cursor_blink=False)
        paths = []
        async with app.run_test(size=size) as pilot:
            await wait_for(pilot, lambda: node.snapshot().status == "ready", 240, "model ready")
            await pilot.press("6")
            chat = app.screen
            chat.query_one("#prompt", Input).value = "Write a python function that returns the n-th fibonacci number"
            await pilot.press("enter")
            await wait_for(pilot, lambda: len(chat.query(ChatMessage)) == 2, 5, "prompt sent")
            await wait_for(pilot, lambda: not list(chat.query(ChatMessage))[-1].pending, 240, "answer")
            await pilot.pause(0.5)
            paths.append(app.save_screenshot("tui-chat.svg", out_dir))
            for key, name in (("f1", "tui-mesh.svg"), ("f3", "tui-speculation.svg")):
                await pilot.press(key)
                await pilot.pause(0.6)
                paths.append(app.save_screenshot(name, out_dir))
            await pilot.press("q")
            await pilot.pause()
        return paths


if __name__ == "__main__":
    print("\n".join(asyncio.run(save_readme_screenshots(sys.argv[1] if len(sys.argv) > 1 else "assets"))))
