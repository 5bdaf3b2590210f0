"""A draft model in the real ModelServer loop, with a fake pipeline (pure logic): when its
work happens relative to what the client receives. Real llama.cpp drafts through a real
split: tests/test_spec_serving.py."""

from __future__ import annotations

import asyncio
import logging
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
    """A draft model whose prefill of a prompt takes ``prefill_s`` (a big prompt; a piece
    of it the same share of that) and that never has a draft."""

    def __init__(self, prefill_s: float) -> None:
        self.prefill_s = prefill_s
        self.prefilled_at: list[float] = []   # when it had caught up on a whole prompt
        self.pieces: list[int] = []           # rows of each catch-up call
        self._lag = 0
        self._row_s = 0.0

    def reset(self, prompt, *, sync: bool = True) -> None:
        self._lag = len(prompt)
        self._row_s = self.prefill_s / max(1, len(prompt))
        if sync:
            self.sync()

    def sync(self, max_rows=None) -> None:
        assert threading.current_thread() is not threading.main_thread()   # the compute thread
        rows = self._lag if max_rows is None else min(self._lag, max_rows)
        time.sleep(self._row_s * rows)
        self.pieces.append(rows)
        self._lag -= rows
        if not self._lag:
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
    # (one node: a split catches up in the background, test_on_a_split_... below)
    draft = SlowStartDraft(0.4)
    pipe = OraclePipeline(CharTokenizer().encode(CODE) + CharTokenizer().encode(ANSWER))
    pipe.n_stages = 1
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


def _timed_answer(draft: SlowStartDraft, n_stages: int, max_tokens: int, delay: float):
    tok = CharTokenizer()
    spec = SpecConfig("draft", "draft-model", "auto", "draft.gguf", WindowPolicy(), "test")

    async def main():
        pipe = _TimedPipeline(tok.encode(CODE) + tok.encode(ANSWER), delay)
        pipe.n_stages = n_stages
        # n_batch: the prompt in one step, so the first decode step is the second one
        server = ModelServer(ServeSettings("m", n_ctx=1024, n_batch=1024, spec=spec), tok, pipe, draft=draft)
        text, _ = await answer(server, GenerationRequest("r", "m", messages=(ChatMessage("user", CODE),),
                                                         max_tokens=max_tokens, temperature=0.0))
        await server.scheduler.close()
        return text, pipe.started

    return asyncio.run(main())


def test_on_a_split_the_draft_catches_up_while_steps_are_away():
    """On a split the draft prefills the prompt in the background, a piece while each
    decode step is at the stages (those steps go without the draft's help), pieces sized
    to that time; on one node all at once before the step that needs it, which waits.
    Both texts are exact."""
    for n_stages in (2, 1):
        draft = SlowStartDraft(0.3)
        text, started = _timed_answer(draft, n_stages, 40, 0.05)
        assert text == ANSWER[:40]
        (_, prompt_pos), (first_decode, pos) = started[0], started[1]
        assert prompt_pos == 0 and pos > 0 and draft.prefilled_at
        if n_stages == 2:
            assert first_decode < draft.prefilled_at[0] - 0.1, (first_decode, draft.prefilled_at)
            # the whole prompt in pieces, none of them the whole prompt at once
            assert len(draft.pieces) >= 4 and sum(draft.pieces[:-1]) >= 164 - UNIFORM_CATCHUP_ROWS, draft.pieces
        else:   # (auto: the first few tokens are plain, then a step waits for the prefill)
            times = [t for t, _ in started]
            k = next(i for i, t in enumerate(times) if t >= draft.prefilled_at[0])
            assert times[k] - times[k - 1] >= 0.25, times


def test_on_a_split_a_draft_too_slow_to_catch_up_in_time_is_left_behind():
    # a draft as slow as the target on a CPU: each piece overruns the step it ran beside,
    # the pieces halve, and once the rest of the prompt would not be caught up before the
    # answer's end no more are started: the answer is not slowed down for nothing
    draft = SlowStartDraft(8.0)      # ~49 ms a row, against 20 ms a step
    text, _ = _timed_answer(draft, 2, 40, 0.02)
    assert text == ANSWER[:40]
    assert not draft.prefilled_at
    assert 1 <= len(draft.pieces) <= 4 and sum(draft.pieces) <= 16 + 8 + 4 + 2, draft.pieces


def test_on_one_node_a_draft_too_slow_for_the_answer_is_not_caught_up(caplog):
    # On one node the request waits for the draft's catch-up: once the draft's rate is
    # known, a request whose prompt it would take longer to catch up on than half of
    # decoding the answer plainly drafts by n-gram alone; a short prompt still takes it.
    tok = CharTokenizer()
    draft = RecordingDraft()
    draft.prefill_s = 0.5               # ~3 ms a row, against 10 ms a step
    spec = SpecConfig("draft", "draft-model", "auto", "draft.gguf", WindowPolicy(), "test")

    async def main():
        pipe = OraclePipeline(tok.encode(CODE) + tok.encode(ANSWER), 0.01)
        pipe.n_stages = 1
        server = ModelServer(ServeSettings("m", n_ctx=1024, spec=spec), tok, pipe, draft=draft)
        texts = []
        for max_tokens in (40, 8):      # the first measures the rate; the second is short
            req = GenerationRequest(f"r{max_tokens}", "m", messages=(ChatMessage("user", CODE),),
                                    max_tokens=max_tokens, temperature=0.0)
            texts.append((await answer(server, req))[0])
        await server.scheduler.close()
        return texts

    with caplog.at_level(logging.INFO, logger="meshnode.serve.speculation"):
        texts = asyncio.run(main())
    assert texts == [ANSWER[:40], ANSWER[:8]]
    assert draft.resets == 1 and len(draft.prefilled_at) == 1, (draft.resets, draft.prefilled_at)
    told = [r for r in caplog.records if "would not catch up in time" in r.getMessage()]
    assert len(told) == 1 and told[0].levelno == logging.INFO, told    # the user learns why
