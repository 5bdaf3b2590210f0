"""ModelServer.shutdown, the drain logic alone (a fake pipeline; the real thing, with
node processes, signals and HTTP, is tests/test_shutdown.py)."""

from __future__ import annotations

import asyncio

import pytest

from char_tokenizer import CharTokenizer
from meshnode.mesh.final import Finalized
from meshnode.serve.client import Finished, GenerationRequest, TextDelta
from meshnode.serve.errors import EngineUnavailableError
from meshnode.serve.model_server import ENDED_AT_SHUTDOWN, SHUTTING_DOWN, ModelServer, ServeSettings

STEP_S = 0.01


class _SlowStages:
    """Says ``a``, one token every STEP_S seconds; records the sessions it freed."""

    n_stages = 1

    def __init__(self) -> None:
        self.ended: list[int] = []

    async def run(self, steps):
        await asyncio.sleep(STEP_S)
        return [Finalized((ord("a"),), 0, 0) if s.n_logits else None for s in steps]

    async def end_session(self, session: int) -> None:
        self.ended.append(session)

    async def close(self) -> None: ...


async def _consume(server: ModelServer, rid: str, max_tokens: int, out: list) -> None:
    req = GenerationRequest(rid, "m", prompt="hi", max_tokens=max_tokens, temperature=0)
    async for ev in server.generate(req):
        out.append(ev)


async def test_shutdown_lets_short_requests_finish_and_ends_the_rest():
    stages = _SlowStages()
    server = ModelServer(ServeSettings("m", n_ctx=4096, parallel=4), CharTokenizer(), stages)
    short: list = []
    long: list = []
    tasks = [asyncio.ensure_future(_consume(server, "short", 20, short)),      # ~0.2 s
             asyncio.ensure_future(_consume(server, "long", 3000, long))]      # ~30 s
    while not any(isinstance(e, TextDelta) for e in long):
        await asyncio.sleep(STEP_S)
    ended = await asyncio.wait_for(server.shutdown(1.0), 1.0 + 1.0)
    assert ended == 1
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert results[0] is None and isinstance(short[-1], Finished)   # finished within the grace
    assert isinstance(results[1], EngineUnavailableError) and str(results[1]) == ENDED_AT_SHUTDOWN
    assert sum(isinstance(e, TextDelta) for e in long) > 1            # its text came first
    assert len(stages.ended) == 2                                    # both sessions freed
    # once shutdown began, a new request is refused before anything runs
    with pytest.raises(EngineUnavailableError, match="shutting down") as ei:
        await _consume(server, "late", 5, [])
    assert str(ei.value) == SHUTTING_DOWN
    await server.close()


async def test_shutdown_of_an_idle_server_returns_at_once():
    server = ModelServer(ServeSettings("m"), CharTokenizer(), _SlowStages())
    assert await asyncio.wait_for(server.shutdown(30.0), 0.5) == 0
    await server.close()
