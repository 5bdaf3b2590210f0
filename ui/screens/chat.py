"""Chat: a prompt box that talks to the node's own OpenAI endpoint and streams the answer.

Any model ready in the mesh can answer (the node's endpoint carries a request for a
member's model to its coordinator): the line above the prompt names the model asked and
where it runs, and Ctrl+O moves to the next one.

The HTTP work lives in :mod:`ui.chat_client`; this screen only runs it in a worker and
draws what comes back. Errors (HTTP, in-band, connection) are shown in the transcript.
"""

from __future__ import annotations

import time

import httpx

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Input, Static

from meshnode.state import NodeSnapshot
from ui.chat_client import ChatDelta, ChatFailed, ChatFinished, stream_chat
from ui.format import peer_text
from ui.screens.base import NodeScreen


class ChatMessage(Static):
    """One turn of the transcript."""

    def __init__(self, role: str, text: str = "") -> None:
        super().__init__(classes=f"msg msg-{role}")
        self.role = role
        self.text = text
        self.error: str | None = None
        self.pending = role == "assistant"

    def on_mount(self) -> None:
        self.redraw()

    def redraw(self) -> None:
        out = Text()
        out.append("you › " if self.role == "user" else "model › ", style="bold")
        out.append(self.text)
        if self.pending:
            out.append("…", style="dim")
        if self.error:
            out.append("\n" if self.text else "")
            out.append(f"✗ error: {self.error}", style="bold red")
        self.update(out)


class ChatScreen(NodeScreen):
    TITLE = "Chat"
    BINDINGS = [
        Binding("escape", "stop_or_leave", "Stop/leave", tooltip="Stop the answer, or leave the prompt"),
        Binding("ctrl+n", "new_chat", "New chat", show=False),
        Binding("ctrl+o", "next_model", "Model", tooltip="Ask the next model of the mesh"),
    ]
    UPDATE_INTERVAL = 0.05  # s between redraws of a streaming answer

    def __init__(self) -> None:
        super().__init__()
        self.history: list[dict[str, str]] = []
        self.streaming = False
        self.chosen: str | None = None    # the model picked with Ctrl+O (None: the default)

    def compose_body(self) -> ComposeResult:
        yield VerticalScroll(
            Static("Type a prompt and press Enter; the answer streams from this node's endpoint.",
                   classes="chat-hint"),
            id="transcript",
        )
        yield Static("", id="chat-model")
        prompt = Input(placeholder="Ask the model…  (Enter sends · Esc leaves · F1-F7 switch screens)", id="prompt")
        prompt.cursor_blink = self.mesh_app.cursor_blink
        yield prompt

    def on_mount(self) -> None:
        super().on_mount()
        self.query_one("#prompt", Input).focus()

    def on_screen_resume(self) -> None:
        super().on_screen_resume()
        self.query_one("#prompt", Input).focus()

    def mesh_model_names(self, snap: NodeSnapshot | None) -> list[str]:
        if snap is None:
            return []
        names = [m.name for m in snap.mesh_models]
        if snap.model and snap.model not in names:
            names.insert(0, snap.model)
        return names

    def current_model(self, snap: NodeSnapshot | None) -> str | None:
        """The model asked: the one picked while the mesh serves it, else this node's,
        else the first the mesh serves."""
        names = self.mesh_model_names(snap)
        if self.chosen in names:
            return self.chosen
        if snap is not None and snap.model and snap.model in names:
            return snap.model
        return names[0] if names else None

    def show_snapshot(self, snap: NodeSnapshot) -> None:
        model = self.current_model(snap)
        line = Text("model › ", style="dim")
        if model is None:
            line.append("none ready in the mesh yet", style="dim")
        else:
            line.append_text(peer_text(model, 100))
            where = next((m for m in snap.mesh_models if m.name == model), None)
            if where is not None and not where.local:
                line.append(" on ", style="dim")
                line.append_text(peer_text(where.coordinator_name or where.coordinator_id, 64))
            if len(self.mesh_model_names(snap)) > 1:
                line.append("  (Ctrl+O: next model)", style="dim")
        self.query_one("#chat-model", Static).update(line)

    def action_next_model(self) -> None:
        snap = self.mesh_app.latest_snapshot
        names = self.mesh_model_names(snap)
        if not names:
            return
        current = self.current_model(snap)
        self.chosen = names[(names.index(current) + 1) % len(names)] if current in names else names[0]
        if snap is not None:
            self.show_snapshot(snap)

    def action_stop_or_leave(self) -> None:
        if self.streaming:
            self.workers.cancel_group(self, "chat")
        else:
            self.query_one("#transcript").focus()

    def action_new_chat(self) -> None:
        self.workers.cancel_group(self, "chat")
        self.history.clear()
        self.query_one("#transcript").remove_children(ChatMessage)

    async def on_input_submitted(self, event: Input.Submitted) -> None:
        prompt = event.value.strip()
        if not prompt:
            return
        if self.streaming:
            self.notify("Still answering: Esc stops the answer", severity="warning")
            return
        event.input.clear()
        transcript = self.query_one("#transcript", VerticalScroll)
        answer = ChatMessage("assistant")
        await transcript.mount_all([ChatMessage("user", prompt), answer])
        transcript.scroll_end(animate=False)
        self.history.append({"role": "user", "content": prompt})
        self.streaming = True
        self.ask(answer)

    @work(exclusive=True, group="chat", exit_on_error=False)
    async def ask(self, answer: ChatMessage) -> None:
        app = self.mesh_app
        transcript = self.query_one("#transcript", VerticalScroll)
        snap = app.latest_snapshot
        finished = False
        try:
            model = self.current_model(snap)
            if model is None:
                answer.error = "no model is ready in the mesh yet (see the Mesh screen)"
                return
            last_draw = 0.0
            # a node started with --api-key wants it from its own TUI too
            key = getattr(getattr(app.node, "http_security", None), "api_key", None)
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            # The endpoint is this machine's: never through an HTTP proxy from the environment.
            async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0), headers=headers,
                                         trust_env=False) as client:
                async for chunk in stream_chat(client, app.node.http_url, model, self.history,
                                               temperature=app.chat_temperature):
                    match chunk:
                        case ChatDelta(text=text):
                            answer.text += text
                            now = time.monotonic()
                            if now - last_draw >= self.UPDATE_INTERVAL:
                                last_draw = now
                                answer.redraw()
                                transcript.scroll_end(animate=False)
                        case ChatFinished():
                            finished = True
                            self.history.append({"role": "assistant", "content": answer.text})
                        case ChatFailed(message=message):
                            answer.error = message
        finally:
            if not finished:
                # keep the conversation consistent: forget the unanswered prompt
                if self.history and self.history[-1]["role"] == "user":
                    self.history.pop()
                if answer.error is None:
                    answer.text += " (stopped)"
            answer.pending = False
            answer.redraw()
            transcript.scroll_end(animate=False)
            self.streaming = False
