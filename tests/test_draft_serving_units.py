"""A draft model in the real ModelServer loop, with a fake pipeline (pure logic): when its
work happens relative to what the client receives. Real llama.cpp drafts through a real
split: tests/test_spec_serving.py."""

from __future__ import annotations

import asyncio
import threading
import time

from char_tokenizer import CharTokenizer
from meshnode.serve.client import ChatMessage, GenerationRequest, TextDelta
from meshnode.serve.model_server import ModelServer, ServeSettings
from meshnode.spec.strategy import SpecConfig
from meshnode.spec.window import WindowPolicy
from inproc import answer
from test_lookahead_serving import ANSWER, CODE, OraclePipeline


class SlowStartDraft:
    """A draft model whose prefill of a prompt takes ``prefill_s`` (a big prompt) and
    that never has a draft."""

    def __init__(self, prefill_s: float) -> None:
        self.prefill_s = prefill_s
        self.prefilled_at: list[float] = []
        self._lag = 0

    def reset(self, prompt, *, sync: bool = True) -> None:
        self._lag = len(prompt)
        if sync:
            self.sync()

    def sync(self) -> None:
        assert threading.current_thread() is not threading.main_thread()   # the compute thread
        time.sleep(self.prefill_s)
        self._lag = 0
        self.prefilled_at.append(time.monotonic())

    @property
    def lag(self) -> int:
        return self._lag

    def propose(self, context_tail, k: int) -> list[int]:
        if self._lag:
            self.sync()
        return []

    def accept(self, tokens) -> None:
        self._lag += len(tokens)

    def close(self) -> None: ...


def test_the_first_token_reaches_the_client_before_the_draft_prefills_the_prompt():
    draft = SlowStartDraft(0.4)
    pipe = OraclePipeline(CharTokenizer().encode(CODE) + CharTokenizer().encode(ANSWER))
    spec = SpecConfig("draft", "draft-model", "on", "draft.gguf", WindowPolicy(), "test")

    async def main() -> tuple[list[float], str]:
        server = ModelServer(ServeSettings("m", n_ctx=1024, spec=spec), CharTokenizer(), pipe, draft=draft)
        arrivals, text = [], ""
        req = GenerationRequest("r1", "m", messages=(ChatMessage("user", CODE),), max_tokens=6,
                                temperature=0.0)
        async for ev in server.generate(req):
            if isinstance(ev, TextDelta) and ev.text:
                arrivals.append(time.monotonic())
                text += ev.text
        await server.scheduler.close()
        return arrivals, text

    arrivals, text = asyncio.run(main())
    assert text == ANSWER[:6]
    # the draft prefilled the prompt once (a policy that drafts: at the request's start)
    assert len(draft.prefilled_at) >= 1
    assert arrivals[0] < draft.prefilled_at[0] - 0.2, (arrivals, draft.prefilled_at)


class RecordingDraft(SlowStartDraft):
    """Remembers the context it was given (a prompt, then the accepted tokens)."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.context: list[int] = []
        self.resets = 0

    def reset(self, prompt, *, sync: bool = True) -> None:
        self.context = list(prompt)
        self.resets += 1
        super().reset(prompt, sync=sync)

    def accept(self, tokens) -> None:
        self.context += list(tokens)
        super().accept(tokens)


def test_the_draft_model_follows_one_request_at_a_time():
    """Two requests at once: the draft model's context is one request's prompt and answer
    (not both interleaved); the other drafts without it; both texts are exact; once both
    end the next request takes the draft."""
    tok = CharTokenizer()
    draft = RecordingDraft()
    spec = SpecConfig("draft", "draft-model", "on", "draft.gguf", WindowPolicy(), "test")

    async def main():
        pipe = OraclePipeline(tok.encode(CODE) + tok.encode(ANSWER))
        server = ModelServer(ServeSettings("m", n_ctx=1024, parallel=2, spec=spec), tok, pipe, draft=draft)
        reqs = [GenerationRequest(f"r{i}", "m", messages=(ChatMessage("user", CODE),), max_tokens=40,
                                  temperature=0.0) for i in range(2)]
        texts = await asyncio.gather(*(answer(server, r) for r in reqs))
        first_context, first_resets = list(draft.context), draft.resets
        third = await answer(server, reqs[0])
        await server.scheduler.close()
        return [t for t, _ in texts], first_context, first_resets, third[0], pipe

    texts, context, resets, third, pipe = asyncio.run(main())
    assert texts == [ANSWER[:40]] * 2 and third == ANSWER[:40]
    assert resets == 1
    prompt_len = len(context) - 40   # the prompt as templated, then 40 answer tokens
    assert tok.decode(context[prompt_len:]) == ANSWER[:40], tok.decode(context[prompt_len:])
    assert draft.resets == 2   # the third request took the free draft
