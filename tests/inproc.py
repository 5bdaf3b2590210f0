"""In-process helpers for tests of the serving layer: an app on real HTTP, a request's text."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import uvicorn

from meshnode.serve.client import GenerationRequest
from meshnode.serve.model_server import ModelServer


def serve_app(app) -> Iterator[str]:
    """uvicorn on 127.0.0.1:0 in a thread; yields the base URL (no /v1), then stops it."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(5)


async def answer(server: ModelServer, req: GenerationRequest):
    """The text ``req`` generates and its Finished event (None when there was none)."""
    from meshnode.serve.client import Finished, TextDelta

    text, finished = "", None
    async for ev in server.generate(req):
        if isinstance(ev, TextDelta):
            text += ev.text
        elif isinstance(ev, Finished):
            finished = ev
    return text, finished


async def collect(server: ModelServer, req: GenerationRequest) -> str | BaseException:
    """The text ``req`` generates, or the exception that ended it (the request's outcome)."""
    text = []
    try:
        async for ev in server.generate(req):
            if hasattr(ev, "text"):
                text.append(ev.text)
    except Exception as exc:  # noqa: BLE001 - the request's outcome
        return exc
    return "".join(text)
