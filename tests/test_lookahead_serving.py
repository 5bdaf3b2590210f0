"""Stage 0's lookahead windows (meshnode.spec.lookahead) through the real ModelServer loop.

Pure logic: a fake 2-stage pipeline whose "model" knows the one right continuation
(an oracle text), verifies windows exactly as the final stage does (accepted prefix +
bonus) and enforces the engine's position rule (a step may start at or before the
session's next position, rewinding it, never after: a gap). The n-gram proposer, auto
policy, window controller, lookahead gate and scheduler are the real ones. Real llama.cpp
and QUIC coverage of the same path: tests/test_spec_serving.py.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from meshnode.serve.client import ChatMessage, GenerationRequest, TextDelta
from meshnode.mesh.final import Finalized
from meshnode.serve.model_server import ModelServer, ServeSettings
from meshnode.spec.window import WindowPolicy
from meshnode.spec.strategy import SpecConfig
from char_tokenizer import CharTokenizer
from inproc import answer

# The answer copies the prompt's code with a few edits, so the n-gram proposer runs
# long, and its guesses fail at every edit.
CODE = "def total(items):\n    s = 0\n    for x in items:\n        s += x.price\n    return s\n" * 2
GARBAGE = ord("~")   # what the fake model says after a context it was not trained on
ANSWER = CODE.replace("total", "sum_all", 1).replace("price", "cost", 2) + "# done\n"


class OraclePipeline:
    """Two stages' worth of delay. The "model" continues the true text (``truth``) only
    from a KV that holds exactly the true text so far; anything else gets GARBAGE."""

    n_stages = 2

    def __init__(self, truth: list[int], delay: float = 0.005) -> None:
        self.truth = truth
        self.delay = delay
        self.kv: dict[int, list[int]] = {}          # session -> token at each position
        self.steps: list[tuple[int, int, int]] = []   # (pos, rows, drafts)
        self.drafted: list[int] = []                   # every draft token sent
        self.in_flight = 0
        self.max_in_flight = 0

    async def run(self, steps):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            out = []
            for s in steps:
                rows, k = len(s.tokens), len(s.drafts)
                kv = self.kv.setdefault(s.session, [])
                assert s.pos <= len(kv), f"gap: step at {s.pos}, session is at {len(kv)}"
                del kv[s.pos:]                              # rewinds past rejected rows
                kv.extend(int(t) for t in s.tokens)
                self.steps.append((s.pos, rows, k))
                self.drafted += s.drafts

                def predict(q: int) -> int:
                    # like a model: right only when everything up to q is the true text
                    return self.truth[q + 1] if kv[:q + 1] == self.truth[:q + 1] else GARBAGE

                base = s.pos + rows - k - 1                # position of `last`
                n = 0
                while n < k and s.drafts[n] == predict(base + n):
                    n += 1
                out.append(Finalized((*s.drafts[:n], predict(base + n)), n, k) if s.n_logits else None)
            await asyncio.sleep(self.delay)
            return out
        finally:
            self.in_flight -= 1

    async def copy_session(self, src: int, dst: int, n_pos: int) -> None:
        # the engine's rule: a new session gets the first n_pos positions src holds
        assert dst not in self.kv and n_pos <= len(self.kv[src])
        self.kv[dst] = self.kv[src][:n_pos]

    async def end_session(self, session: int) -> None:
        self.kv.pop(session, None)

    async def close(self) -> None: ...


def _spec(mode: str = "on", window: WindowPolicy | None = None) -> SpecConfig:
    return SpecConfig("ngram", "ngram", mode, None, window or WindowPolicy(), "test")


async def _generate(server: ModelServer, max_tokens: int, temperature: float = 0.0):
    return await answer(server, GenerationRequest("r1", "m", messages=(ChatMessage("user", CODE),),
                                                  max_tokens=max_tokens, temperature=temperature, seed=1))


def _server(pipe: OraclePipeline, spec: SpecConfig | None) -> ModelServer:
    return ModelServer(ServeSettings("m", n_ctx=1024, spec=spec), CharTokenizer(), pipe)


def _edited(seed: int) -> str:
    """CODE with a few characters changed at random places: edits anywhere in a window,
    including right where a window's bonus token falls."""
    rng = random.Random(seed)
    chars = list(CODE)
    for i in rng.sample(range(len(chars)), 4):
        chars[i] = rng.choice("XYZ")
    return "".join(chars)


async def _run_answer(answer: str, max_tokens: int):
    pipe = OraclePipeline(CharTokenizer().encode(CODE) + CharTokenizer().encode(answer))
    server = _server(pipe, _spec())
    text, fin = await _generate(server, max_tokens)
    await server.scheduler.close()
    return pipe, text, fin


@pytest.mark.parametrize("max_tokens", [len(ANSWER), 40])
def test_lookahead_keeps_the_exact_text_and_overlaps_steps(max_tokens):
    pipe, text, fin = asyncio.run(_run_answer(ANSWER, max_tokens))
    assert text == ANSWER[:max_tokens]
    t = fin.timings
    assert t.draft_lookahead >= 1 and t.draft_lookahead_used >= 1
    assert pipe.max_in_flight == 2            # a lookahead rode behind a window
    if max_tokens == len(ANSWER):
        # the edits make some guesses fail; the text above is still exact
        assert t.draft_lookahead_used < t.draft_lookahead
    # decode steps are [last, *drafts]; none started past its session (checked in run)
    assert all(rows == k + 1 for pos, rows, k in pipe.steps if pos >= len(CODE))


def test_exact_under_random_edits():
    sent = used = 0
    for seed in range(12):
        answer = _edited(seed)
        _, text, fin = asyncio.run(_run_answer(answer, len(answer)))
        assert text == answer, seed
        sent, used = sent + fin.timings.draft_lookahead, used + fin.timings.draft_lookahead_used
    assert 0 < used < sent


def test_drafts_stop_before_a_token_the_request_bans():
    """logit_bias -100 on a token: no window spends a row on it (it would be rejected),
    the others still draft. (The oracle ignores the bias: the text keeps its x's.)"""
    x = ord("x")

    async def main():
        pipe = OraclePipeline(CharTokenizer().encode(CODE) + CharTokenizer().encode(ANSWER))
        server = _server(pipe, _spec())
        text, fin = await answer(server, GenerationRequest("r1", "m", messages=(ChatMessage("user", CODE),),
                                                           max_tokens=len(ANSWER), temperature=0.0,
                                                           logit_bias=((x, -100.0), (ord(" "), -10.0))))
        await server.scheduler.close()
        return pipe, text, fin

    pipe, text, fin = asyncio.run(main())
    assert text == ANSWER
    assert x not in pipe.drafted and ord(" ") in pipe.drafted    # (a bias of -10 is no ban)
    assert fin.timings.draft_n_accepted > 20


def test_no_lookahead_when_sampling_or_on_one_node():
    truth = CharTokenizer().encode(CODE) + CharTokenizer().encode(ANSWER)

    async def run(n_stages: int, temperature: float):
        pipe = OraclePipeline(truth)
        pipe.n_stages = n_stages
        server = _server(pipe, _spec())
        _, fin = await _generate(server, 60, temperature)
        await server.scheduler.close()
        return pipe, fin

    for n_stages, temperature in ((1, 0.0), (2, 0.7)):
        pipe, fin = asyncio.run(run(n_stages, temperature))
        assert fin.timings.draft_lookahead == 0 and pipe.max_in_flight == 1


class _JitterPipeline(OraclePipeline):
    """Steps take random times, so results, lookaheads and withdrawals interleave in
    every order the scheduler allows."""

    def __init__(self, truth: list[int], rng: random.Random) -> None:
        super().__init__(truth)
        self.rng = rng

    async def run(self, steps):
        self.delay = self.rng.choice([0.0, 0.0005, 0.002, 0.006])
        return await super().run(steps)


def test_exact_under_random_timing_and_request_ends():
    async def main(seed: int) -> list[tuple[str, str]]:
        rng = random.Random(seed)
        answer = _edited(seed)
        pipe = _JitterPipeline(CharTokenizer().encode(CODE) + CharTokenizer().encode(answer), rng)
        server = _server(pipe, _spec("on" if seed % 2 else "auto"))
        got = []
        for r in range(2):   # the second request starts right after a lookahead was dropped
            n = rng.choice([17, 30, len(answer)])
            req = GenerationRequest(f"r{r}", "m", messages=(ChatMessage("user", CODE),),
                                    max_tokens=n, temperature=0.0)
            text = ""
            async for ev in server.generate(req):
                if isinstance(ev, TextDelta):
                    text += ev.text
            got.append((text, answer[:n]))
        await server.scheduler.close()
        # every session was freed but the one kept for prefix reuse, which the second
        # request started from (the oracle answers GARBAGE to any KV but the true text)
        assert set(pipe.kv) <= set(server.prefix.sessions()) and 1 <= len(server.prefix) <= 2
        assert server.prefix.stats.hits == 1
        return got

    for seed in range(40):
        for text, want in asyncio.run(main(seed)):
            assert text == want, seed


class _OrderPipeline(OraclePipeline):
    """Records, as each decode step starts, which generated token it feeds, how many
    tokens the model server had taken from the steps before it, and its rows."""

    server: ModelServer

    def __init__(self, truth: list[int]) -> None:
        super().__init__(truth)
        self.order: list[tuple[int, int, int]] = []   # (index of the token fed, tokens taken, rows)

    async def run(self, steps):
        (ar,) = self.server._active.values()
        if steps[0].pos >= len(ar.prompt):
            self.order.append((steps[0].pos - len(ar.prompt), len(ar.generated), len(steps[0].tokens)))
        return await super().run(steps)


@pytest.mark.parametrize("spec", [None, _spec()])
def test_the_next_step_starts_before_the_text_of_this_one(spec):
    """docs/speculative.md, "The next step goes first": a decode step is sent before the
    model server takes the tokens of the step before it (their text, the SSE chunk)."""
    async def main():
        pipe = _OrderPipeline(CharTokenizer().encode(CODE) + CharTokenizer().encode(ANSWER))
        server = pipe.server = _server(pipe, spec)
        text, _ = await _generate(server, 60)
        await server.scheduler.close()
        return pipe, text

    pipe, text = asyncio.run(main())
    assert text == ANSWER[:60]
    (first, *later) = pipe.order
    assert first[:2] == (0, 1)                    # fed after the prefill's token was taken
    # ... every later plain step before the tokens of the step ahead of it (fed, its last
    # token, lies at or past what was taken); windows may be lookaheads queued behind one
    plain = [(fed, taken) for fed, taken, rows in later if rows == 1]
    assert len(plain) >= 5 and all(taken <= fed for fed, taken in plain)


def test_windows_on_a_gpu_route_never_straddle_a_kv_bucket():
    """On a GPU stage a row attends llama.cpp's padded KV length, which a window may reach
    differently from the row's own one-row step (limits.gpu_bucket_drafts): on a route with
    a GPU stage no window or lookahead crosses such an edge, on a CPU route they do (the
    answer runs across position 256), and the text is the same."""
    from dataclasses import dataclass

    from meshnode.limits import gpu_bucket_drafts

    @dataclass(frozen=True)
    class Stage:
        backend: str
        gpu_pad_rows: int = 0

    truth = CharTokenizer().encode(CODE) + CharTokenizer().encode(ANSWER)

    async def run(route):
        pipe = OraclePipeline(truth)
        # windows of 8 (the route cuts them), not sized by this fake pipeline's timings
        server = _server(pipe, _spec(window=WindowPolicy("fixed", 8, 8, 8)))
        server.follow_route(route)
        text, _ = await _generate(server, len(ANSWER))
        await server.scheduler.close()
        return pipe, text

    def straddling(pipe, pad):
        return [(pos, k) for pos, _, k in pipe.steps if k > gpu_bucket_drafts(pos, pad)]

    cpu, cpu_text = asyncio.run(run([Stage("cpu"), Stage("cpu")]))
    assert cpu_text == ANSWER and straddling(cpu, 2) and straddling(cpu, 8)
    for pad in (2, 8):
        gpu, gpu_text = asyncio.run(run([Stage("cpu"), Stage("cuda", pad)]))
        assert gpu_text == ANSWER
        assert [k for _, _, k in gpu.steps if k] and not straddling(gpu, pad)


class _OracleDraft:
    """A draft model that knows the true text (the ideal draft), counting its calls."""

    def __init__(self, truth: list[int]) -> None:
        self.truth = truth
        self.context: list[int] = []
        self.calls = 0

    def reset(self, prompt, *, sync: bool = True) -> None:
        self.context = list(prompt)

    def propose(self, context_tail, k: int) -> list[int]:
        self.calls += 1
        n = len(self.context)
        return list(self.truth[n:n + k]) if self.context == self.truth[:n] else []

    def accept(self, tokens) -> None:
        self.context.extend(tokens)

    lag = 0              # (it knows every token at once: nothing to catch up on)

    def sync(self, max_rows=None) -> None: ...

    def close(self) -> None: ...


def test_a_draft_model_is_asked_only_where_the_text_has_no_repeat_to_draft_from():
    """With a draft model, a step drafts from the text's own repeats when the n-gram
    proposer has some (free) and asks the draft model only otherwise; the text is exact."""
    truth = CharTokenizer().encode(CODE) + CharTokenizer().encode(ANSWER)

    async def run():
        pipe = OraclePipeline(truth)
        draft = _OracleDraft(truth)
        spec = SpecConfig("d", "draft-model", "on", "d.gguf", WindowPolicy(), "test")
        server = ModelServer(ServeSettings("m", n_ctx=1024, spec=spec), CharTokenizer(), pipe, draft=draft)
        text, fin = await _generate(server, len(ANSWER))
        await server.scheduler.close()
        return pipe, draft, text, fin

    pipe, draft, text, fin = asyncio.run(run())
    windows = sum(1 for _, _, k in pipe.steps if k)
    assert text == ANSWER and windows > 0
    # most of the answer copies the prompt: most windows came from the n-gram proposer
    assert 0 < draft.calls < windows / 2
    assert fin.timings.draft_lookahead == 0     # a draft model's state would follow a guess
