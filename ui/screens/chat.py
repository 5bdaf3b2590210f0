"""Chat: a prompt box that talks to the node's own OpenAI endpoint and streams the answer.

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

from ui.chat_client import ChatDelta, ChatFailed, ChatFinished, stream_chat
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
    ]
    UPDATE_INTERVAL = 0.05  # s between redraws of a streaming answer

    def __init__(self) -> None:
        super().__init__()
        self.history: list[dict[str, str]] = []
        self.streaming = False

    def compose_body(self) -> ComposeResult:
        yield VerticalScroll(
            Static("Type a prompt and press Enter; the answer streams from this node's endpoint.",
                   classes="chat-hint"),
            id="transcript",
        )
        prompt = Input(placeholder="Ask the model…  (Enter sends · Esc leaves · F1-F7 switch screens)", id="prompt")
        prompt.cursor_blink = self.mesh_app.cursor_blink
        yield prompt

    def on_mount(self) -> None:
        super().on_mount()
        self.query_one("#prompt", Input).focus()

    def on_screen_resume(self) -> None:
        super().on_screen_resume()
        self.query_one("#prompt", Input).focus()

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
            if snap is None or not snap.model:
                answer.error = "no model is loaded yet (see the Mesh screen)"
                return
            last_draw = 0.0
            # a node started with --api-key wants it from its own TUI too
            key = getattr(getattr(app.node, "http_security", None), "api_key", None)
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            # The endpoint is this machine's: never through an HTTP proxy from the environment.
            async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0), headers=headers,
                                         trust_env=False) as client:
                async for chunk in stream_chat(client, app.node.http_url, snap.model, self.history,
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
