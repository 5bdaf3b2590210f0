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
from meshnode.spec.draft import UNIFORM_CATCHUP_ROWS
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
        if self._lag > UNIFORM_CATCHUP_ROWS:
            self.sync()   # (a prompt: slow)
        self._lag = 0     # (a few tokens: quick)
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


class _TimedPipeline(OraclePipeline):
    """Records when each step reaches the stages."""

    def __init__(self, truth: list[int], delay: float) -> None:
        super().__init__(truth, delay)
        self.started: list[tuple[float, int]] = []   # (time, position)

    async def run(self, steps):
        self.started += [(time.monotonic(), s.pos) for s in steps]
        return await super().run(steps)


def test_on_a_split_the_draft_catches_up_while_the_first_step_is_away():
    """On a split the draft prefills the prompt in the background while the first decode
    step is at the stages (that step goes without the draft's help); on one node before
    the first decode step is sent, as it needs the draft. Both texts are exact."""
    tok = CharTokenizer()
    spec = SpecConfig("draft", "draft-model", "on", "draft.gguf", WindowPolicy(), "test")

    async def main(n_stages: int):
        draft = SlowStartDraft(0.3)
        pipe = _TimedPipeline(tok.encode(CODE) + tok.encode(ANSWER), 0.2)
        pipe.n_stages = n_stages
        # n_batch: the prompt in one step, so the first decode step is the second one
        server = ModelServer(ServeSettings("m", n_ctx=1024, n_batch=1024, spec=spec), tok, pipe, draft=draft)
        text, _ = await answer(server, GenerationRequest("r", "m", messages=(ChatMessage("user", CODE),),
                                                         max_tokens=8, temperature=0.0))
        await server.scheduler.close()
        return text, draft.prefilled_at, pipe.started

    for n_stages in (2, 1):
        text, prefilled, started = asyncio.run(main(n_stages))
        assert text == ANSWER[:8]
        (_, prompt_pos), (first_decode, pos) = started[0], started[1]
        assert prompt_pos == 0 and pos > 0 and prefilled
        if n_stages == 2:
            assert first_decode < prefilled[0] - 0.2, (first_decode, prefilled)
        else:
            assert first_decode >= prefilled[0], (first_decode, prefilled)
