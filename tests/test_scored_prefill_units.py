"""Scored prompts (echo with logprobs) in the model server, with a fake pipeline (pure
logic): their chunks overlap across a split's stages, and a prompt sharing a kept
scored prompt's context takes that context's KV and scores, exactly what it would have
computed. The fake "model" scores a token by the whole KV before it, so a copied KV or a
copied score with one wrong position shows. Real llama.cpp: tests/test_prefix_serving.py
and tests/test_api_features.py."""

from __future__ import annotations

import asyncio

import pytest

from meshnode.mesh.final import Finalized
from meshnode.mesh.logprobs import TokenLogprobs
from meshnode.mesh.pipeline import PipelineUnavailableError
from meshnode.serve.client import GenerationRequest, TextDelta
from meshnode.serve.model_server import ModelServer, ServeSettings
from char_tokenizer import CharTokenizer
from test_lookahead_serving import CODE, OraclePipeline

CONTEXT = CODE + "Which line adds?\nAnswer:"


def _score(kv: list[int], tok: int) -> float:
    """The fake model's logprob of ``tok`` after the KV ``kv``: a function of all of it."""
    return -float((sum((i + 1) * t for i, t in enumerate(kv)) + 7 * tok) % 1009) / 64


class ScoringPipeline(OraclePipeline):
    """The oracle pipeline, scoring a step's ``score`` tokens from the KV before each."""

    def __init__(self) -> None:
        super().__init__(CharTokenizer().encode(CONTEXT), delay=0.003)
        self.copies: list[int] = []

    async def run(self, steps):
        scored = []
        for s in steps:
            kv = self.kv.get(s.session, [])[:s.pos] + [int(t) for t in s.tokens]
            scored.append(TokenLogprobs(tuple(_score(kv[:s.pos + i + 1], t) for i, t in enumerate(s.score)))
                          if s.score else None)
        out = await super().run(steps)
        return [Finalized(r.tokens if s.samples else (), r.n_accepted, r.n_drafted, None, sc)
                if r is not None else (Finalized((), 0, 0, None, sc) if sc is not None else None)
                for s, r, sc in zip(steps, out, scored)]

    async def copy_session(self, src: int, dst: int, n_pos: int) -> None:
        self.copies.append(n_pos)
        await super().copy_session(src, dst, n_pos)


def _server(pipe: ScoringPipeline, **kw) -> ModelServer:
    return ModelServer(ServeSettings("m", n_ctx=1024, n_batch=16, **{"parallel": 2, **kw}), CharTokenizer(), pipe)


async def _scores(server: ModelServer, rid: str, prompt: str) -> tuple[list[float | None], object]:
    """The prompt tokens' logprobs an echo request reports, and its Finished event."""
    lps: list[float | None] = []
    fin = None
    async for ev in server.generate(GenerationRequest(rid, "m", prompt=prompt, echo=True, logprobs=0, max_tokens=1,
                                                      temperature=0.0)):
        if isinstance(ev, TextDelta) and ev.logprobs:
            lps += [e.logprob for e in ev.logprobs]
        elif hasattr(ev, "finish_reason"):
            fin = ev
    return lps, fin


def _expected(prompt: str) -> list[float | None]:
    toks = CharTokenizer().encode(prompt)
    return [None] + [_score(toks[:i], t) for i, t in enumerate(toks) if i]


def test_scored_chunks_overlap_across_the_stages_and_score_every_token():
    async def main():
        pipe = ScoringPipeline()
        server = _server(pipe, prefix_cache=0)
        got = await _scores(server, "a", CONTEXT + " B")
        await server.scheduler.close()
        return pipe, got

    pipe, (lps, fin) = asyncio.run(main())
    n = len(CONTEXT) + 2
    assert lps[:n] == _expected(CONTEXT + " B") and fin.usage.prompt_tokens == n
    # one chunk per stage in flight, as a plain prompt's chunks are (they return at once)
    assert pipe.max_in_flight == 2


def test_a_prompt_sharing_a_scored_context_takes_its_kv_and_scores():
    async def main():
        pipe = ScoringPipeline()
        server = _server(pipe)
        first = await _scores(server, "a", CONTEXT + " A")
        second = await _scores(server, "b", CONTEXT + " B")
        # asking for more alternatives than were kept: computed again in full
        more = []
        async for ev in server.generate(GenerationRequest("c", "m", prompt=CONTEXT + " C", echo=True, logprobs=2,
                                                          max_tokens=1, temperature=0.0)):
            more.append(ev)
        await server.scheduler.close()
        return pipe, first, second, more

    pipe, (lps_a, fin_a), (lps_b, fin_b), more = asyncio.run(main())
    n = len(CONTEXT) + 2
    assert lps_a[:n] == _expected(CONTEXT + " A") and lps_b[:n] == _expected(CONTEXT + " B")
    # the shared context but its last character (" A" and " B" share the space): its
    # score came with the KV; the space and the letter were scored anew
    assert fin_a.timings.cache_n == 0 and fin_b.timings.cache_n == len(CONTEXT)
    assert pipe.copies == [len(CONTEXT)]
    assert more[-1].timings.cache_n == 0


def test_scored_prompts_of_concurrent_clients_compute_their_shared_context_once():
    """Answer choices sent at once as separate requests (an evaluation harness with
    concurrent clients): the later ones wait for the first to be kept, then take its
    context's KV and scores; every score is still the one computed in full."""
    # B's longer ending keeps it in flight after C and D, which waited with it
    prompts = {c: CONTEXT + f" {c}" * (40 if c == "B" else 1) for c in "ABCDE"}

    async def main():
        pipe = ScoringPipeline()
        server = _server(pipe, parallel=4)
        got = await asyncio.gather(*(_scores(server, c, prompts[c]) for c in "ABCD"))
        # and later another: nothing of those is waited for any more
        got.append(await asyncio.wait_for(_scores(server, "E", prompts["E"]), 10))
        await server.scheduler.close()
        return pipe, got

    pipe, got = asyncio.run(main())
    for c, (lps, _) in zip("ABCDE", got):
        assert lps[:len(prompts[c])] == _expected(prompts[c])
    cached = [fin.timings.cache_n for _, fin in got]
    assert sorted(cached[:4]) == [0] + [len(CONTEXT)] * 3 and pipe.copies[:3] == [len(CONTEXT)] * 3
    assert cached[4] >= len(CONTEXT)


class DyingScorer(ScoringPipeline):
    """A ScoringPipeline whose route dies at its ``die_after``-th batch (the gate goes down
    first, as the coordinator's hook does), with scored chunks still queued behind it."""

    def __init__(self, gate_of, die_after: int) -> None:
        super().__init__()
        self.gate_of = gate_of
        self.die_after = die_after
        self.dead = False
        self.batches = 0

    async def run(self, steps):
        if self.dead:
            raise PipelineUnavailableError("pipeline closed")
        if self.batches >= self.die_after:
            self.dead = True
            self.gate_of().lost("stage 1: link lost")
            await asyncio.sleep(0.001)
            raise PipelineUnavailableError("stage 1: link lost")
        self.batches += 1
        return await super().run(steps)


@pytest.mark.parametrize("die_after", [0, 1, 4])
def test_a_scored_prefill_lost_midway_is_scored_whole_on_the_new_route(die_after):
    async def main():
        server: ModelServer | None = None
        old = DyingScorer(lambda: server.route, die_after)
        server = _server(old, prefix_cache=0)
        new = ScoringPipeline()

        async def replan():
            while not old.dead:
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.02)
            server.switch_pipeline(new)

        task = asyncio.ensure_future(replan())
        got = await _scores(server, "a", CONTEXT + " B")
        await task
        await server.scheduler.close()
        return old, new, got

    old, new, (lps, fin) = asyncio.run(main())
    n = len(CONTEXT) + 2
    # every prompt token scored once, in order, as a cold run on one route scores it
    assert old.dead and lps[:n] == _expected(CONTEXT + " B") and fin.usage.prompt_tokens == n
    assert [pos for pos, _, _ in new.steps][:1] == [0]    # the new route prefilled from the start
