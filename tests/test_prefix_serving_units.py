"""The model server's prefix reuse with a fake pipeline (pure logic): the oracle "model"
answers the true text only from a KV that holds exactly the true text, so a copied KV
with one wrong position shows in the answer. Slots: retained sessions give way to live
requests; a re-plan forgets them. Real llama.cpp on a split: tests/test_prefix_serving.py."""

from __future__ import annotations

import asyncio

from meshnode.serve.client import ChatMessage, GenerationRequest
from meshnode.serve.model_server import ModelServer, ServeSettings
from char_tokenizer import CharTokenizer
from inproc import answer
from test_lookahead_serving import ANSWER, CODE, OraclePipeline, _spec

TRUTH = CharTokenizer().encode(CODE) + CharTokenizer().encode(ANSWER)


class CountingPipeline(OraclePipeline):
    def __init__(self, truth, delay: float = 0.002) -> None:
        super().__init__(truth, delay)
        self.copies: list[tuple[int, int, int]] = []

    async def copy_session(self, src: int, dst: int, n_pos: int) -> None:
        self.copies.append((src, dst, n_pos))
        await super().copy_session(src, dst, n_pos)


async def _ask(server: ModelServer, rid: str, max_tokens: int, content: str = CODE):
    return await answer(server, GenerationRequest(rid, "m", messages=(ChatMessage("user", content),),
                                                  max_tokens=max_tokens, temperature=0.0))


def test_a_repeated_prompt_reuses_the_kept_kv_exactly():
    async def main():
        pipe = CountingPipeline(TRUTH)
        server = ModelServer(ServeSettings("m", n_ctx=1024, parallel=2, spec=_spec("on")), CharTokenizer(), pipe)
        first = await _ask(server, "a", 30)
        second = await _ask(server, "b", len(ANSWER))     # same prompt, a longer answer
        await server.scheduler.close()
        return pipe, server, first, second

    pipe, server, (t1, f1), (t2, f2) = asyncio.run(main())
    n_prompt = f1.usage.prompt_tokens
    assert t1 == ANSWER[:30] and t2 == ANSWER
    assert f1.timings.cache_n == 0 and f1.timings.prompt_n == n_prompt
    # all of the prompt but its last token came from the first request's session
    assert f2.timings.cache_n == n_prompt - 1 and f2.timings.prompt_n == 1
    assert len(pipe.copies) == 1 and pipe.copies[0][2] == n_prompt - 1
    # the second request's longer history made the first one useless: only it is kept
    assert list(pipe.kv) == server.prefix.sessions() and len(server.prefix) == 1
    assert server.prefix_stats()["hits"] == 1 and server.sessions_held == 1


def test_kept_sessions_give_their_slots_to_live_requests():
    async def main():
        pipe = CountingPipeline(TRUTH)
        server = ModelServer(ServeSettings("m", n_ctx=1024, parallel=2), CharTokenizer(), pipe)
        await _ask(server, "a", 10)
        assert len(server.prefix) == 1
        # two live requests need both slots: the kept session is freed for one of them
        other = "x" * 40 + CODE
        got = await asyncio.wait_for(asyncio.gather(_ask(server, "b", 5, other), _ask(server, "c", 5, "y" * 40)), 10)
        await server.scheduler.close()
        return pipe, server, got

    pipe, server, got = asyncio.run(main())
    assert all(fin is not None for _, fin in got)
    assert server.prefix.stats.evicted >= 1 and set(pipe.kv) <= set(server.prefix.sessions())
    assert server.sessions_held == len(server.prefix) <= 1


def test_a_replan_forgets_the_kept_sessions():
    async def main():
        old = CountingPipeline(TRUTH)
        server = ModelServer(ServeSettings("m", n_ctx=1024, parallel=2), CharTokenizer(), old)
        await _ask(server, "a", 10)
        kept = server.prefix.sessions()
        new = CountingPipeline(TRUTH)
        server.switch_pipeline(new)
        await asyncio.sleep(0.05)
        # the same prompt on the new route: prefilled in full (nothing copied from the
        # old route's session, which the new pipeline does not hold) and exact
        text, fin = await _ask(server, "b", 20)
        await server.scheduler.close()
        return kept, new, server, text, fin

    kept, new, server, text, fin = asyncio.run(main())
    assert len(kept) == 1 and kept[0] not in server.prefix.sessions()
    assert not new.copies and fin.timings.cache_n == 0 and text == ANSWER[:20]
    assert server.prefix.stats.evicted >= 1


def test_shutdown_frees_the_kept_sessions_on_every_stage():
    async def main():
        pipe = CountingPipeline(TRUTH)
        server = ModelServer(ServeSettings("m", n_ctx=1024, parallel=2), CharTokenizer(), pipe)
        await _ask(server, "a", 10)
        kept = len(server.prefix)
        await server.shutdown(1.0)
        await server.scheduler.close()
        return pipe, server, kept

    pipe, server, kept = asyncio.run(main())
    assert kept == 1 and not pipe.kv and not len(server.prefix) and server.sessions_held == 0


def test_a_request_copying_from_the_only_kept_session_and_another_both_get_a_slot():
    """parallel 2: one session kept, one slot free; a request that would copy from the
    kept session and another that matches nothing arrive together, in both orders.
    Neither waits for the other to finish. Copier first: it takes the free slot and
    copies; its source is not evicted under it, and is given up for the other request
    once copied. Other first: the copier finds no free slot but the one its source holds,
    and nobody else copies from it: it takes that session over whole (no copy, no wait)."""
    async def main(copier_first: bool):
        pipe = CountingPipeline(TRUTH, delay=0.005)
        server = ModelServer(ServeSettings("m", n_ctx=1024, parallel=2), CharTokenizer(), pipe)
        await _ask(server, "a", 10)
        copier = _ask(server, "b", 20)
        other = _ask(server, "c", 60, "z" * 40)
        pair = (copier, other) if copier_first else (other, copier)
        got = await asyncio.wait_for(asyncio.gather(*pair), 10)
        await server.scheduler.close()
        return pipe, server, got if copier_first else got[::-1]

    for copier_first in (True, False):
        pipe, server, ((text, fin), (_, other)) = asyncio.run(main(copier_first))
        assert text == ANSWER[:20] and other is not None
        if copier_first:
            assert fin.timings.cache_n > 0 and len(pipe.copies) == 1
        else:
            assert fin.timings.cache_n > 0 and not pipe.copies and server.prefix.stats.taken == 1
        assert set(pipe.kv) <= set(server.prefix.sessions()) and server.sessions_held == len(server.prefix)


def test_requests_for_the_same_prompt_do_not_wait_behind_each_other_for_the_kept_slot():
    """parallel 2: one session kept (the prompt's), one slot free; two requests for that
    prompt arrive together. The first takes the free slot and copies from the kept
    session; the second must not hold on to the kept session while it waits, or the slot
    it waits for stays kept until the first request ends. It gets that slot once the copy
    is done and answers while the first still decodes."""
    from meshnode.serve.client import Finished, TextDelta

    async def timeline(server, rid, max_tokens, marks):
        req = GenerationRequest(rid, "m", messages=(ChatMessage("user", CODE),), max_tokens=max_tokens,
                                temperature=0.0)
        text, fin = "", None
        async for ev in server.generate(req):
            if isinstance(ev, TextDelta):
                marks.setdefault((rid, "first"), asyncio.get_running_loop().time())
                text += ev.text
            elif isinstance(ev, Finished):
                fin = ev
        marks[(rid, "end")] = asyncio.get_running_loop().time()
        return text, fin

    async def main():
        pipe = CountingPipeline(TRUTH, delay=0.005)
        server = ModelServer(ServeSettings("m", n_ctx=1024, parallel=2), CharTokenizer(), pipe)
        await _ask(server, "a", 10)
        assert len(server.prefix) == 1
        marks: dict = {}
        got = await asyncio.wait_for(asyncio.gather(timeline(server, "long", 60, marks),
                                                    timeline(server, "short", 5, marks)), 20)
        await server.scheduler.close()
        return pipe, server, got, marks

    pipe, server, ((long_text, long_fin), (short_text, short_fin)), marks = asyncio.run(main())
    assert long_text == ANSWER[:60] and short_text == ANSWER[:5]
    assert long_fin.timings.cache_n > 0 and short_fin.timings.cache_n == 0   # its source went to it
    assert marks[("short", "end")] < marks[("long", "end")]
    assert server.sessions_held == len(server.prefix) <= 1


def test_one_slot_keeps_one_session_that_a_greedy_match_takes_over_whole():
    """parallel 1: the finished session stays kept in the only slot; the same prompt again
    (greedy) takes it over whole, nothing copied, and answers exactly; another prompt, or
    a sampled request, frees it first and prefills in full."""
    other = CODE.replace("def", "fn")

    async def main():
        pipe = CountingPipeline(TRUTH)
        server = ModelServer(ServeSettings("m", n_ctx=1024, parallel=1), CharTokenizer(), pipe)
        assert server.prefix.capacity == 1
        first = await _ask(server, "a", 30)
        assert len(server.prefix) == 1 and server.sessions_held == 1
        second = await _ask(server, "b", len(ANSWER))
        third = await _ask(server, "c", 5, other)
        sampled = await answer(server, GenerationRequest("d", "m", messages=(ChatMessage("user", other),),
                                                         max_tokens=5, temperature=0.7, seed=3))
        await server.scheduler.close()
        return pipe, server, first, second, third, sampled

    pipe, server, (t1, f1), (t2, f2), (_, f3), (_, f4) = asyncio.run(main())
    n_prompt = f1.usage.prompt_tokens
    assert t1 == ANSWER[:30] and t2 == ANSWER
    assert f2.timings.cache_n == n_prompt - 1 and pipe.copies == []     # taken over, not copied
    assert f3.timings.cache_n == 0 and f4.timings.cache_n == 0
    assert server.prefix_stats()["hits"] == 1 and server.sessions_held <= 1 and len(pipe.kv) <= 1


def test_the_prefix_cache_setting_is_bounded_by_the_slots():
    for parallel, asked, kept in ((1, None, 1), (1, 0, 0), (1, 5, 1), (2, None, 1), (4, None, 3), (4, 2, 2),
                                  (4, 9, 3)):
        assert ServeSettings("m", parallel=parallel, prefix_cache=asked).prefix_sessions == kept


class _Stage:
    def __init__(self, backend: str) -> None:
        self.backend, self.gpu_pad_rows = backend, 2


def test_on_a_gpu_route_only_whole_prefill_chunks_are_reused():
    """A GPU stage computes a row according to its call's shape: a warm prompt copies a
    multiple of n_batch positions, within the kept prompt (not its generated tokens), and
    prefills the rest in the chunks a cold run uses; a CPU route copies all it shares."""
    nb = 16

    async def main(backend: str):
        pipe = CountingPipeline(TRUTH)
        server = ModelServer(ServeSettings("m", n_ctx=1024, parallel=2, n_batch=nb), CharTokenizer(), pipe)
        server.follow_route([_Stage("cpu"), _Stage(backend)])
        assert server.prefix_stats()["align"] == (1 if backend == "cpu" else nb)
        first = await _ask(server, "a", 30)
        mark = len(pipe.steps)
        second = await _ask(server, "b", len(ANSWER))
        await server.scheduler.close()
        return pipe, first, second, pipe.steps[mark:]

    pipe, (t1, f1), (t2, f2), steps = asyncio.run(main("cuda"))
    n_prompt = f1.usage.prompt_tokens
    aligned = (n_prompt - 1) // nb * nb
    assert t1 == ANSWER[:30] and t2 == ANSWER
    assert aligned < n_prompt - 1 and f2.timings.cache_n == aligned and pipe.copies[0][2] == aligned
    # the rest went in the chunks a cold prefill uses: whole ones from a multiple of n_batch
    prefill = [(pos, rows) for pos, rows, _ in steps if pos < n_prompt]
    assert prefill[0][0] == aligned and all(pos % nb == 0 for pos, _ in prefill)
    assert sum(rows for _, rows in prefill) == n_prompt - aligned

    _, _, (_, f2_cpu), _ = asyncio.run(main("cpu"))
    assert f2_cpu.timings.cache_n == n_prompt - 1


def test_on_a_gpu_route_choices_share_whole_chunks_and_each_computes_the_last():
    """n > 1: the choices share the prompt's KV up to a chunk boundary on a GPU route and
    each computes the last, partial chunk itself (the call a single choice computes it
    in); on a CPU route they share all but the last token."""
    from meshnode.serve.client import Finished, TextDelta

    nb = 16

    async def main(backend: str):
        pipe = CountingPipeline(TRUTH)
        server = ModelServer(ServeSettings("m", n_ctx=1024, parallel=3, n_batch=nb), CharTokenizer(), pipe)
        server.follow_route([_Stage(backend)])
        texts, finished = {}, None
        async for ev in server.generate(GenerationRequest("a", "m", messages=(ChatMessage("user", CODE),),
                                                          max_tokens=12, temperature=0.0, n=2)):
            if isinstance(ev, TextDelta):
                texts[ev.index] = texts.get(ev.index, "") + ev.text
            elif isinstance(ev, Finished):
                finished = ev
        await server.scheduler.close()
        return pipe, texts, finished.usage.prompt_tokens

    for backend in ("cuda", "cpu"):
        pipe, texts, n_prompt = asyncio.run(main(backend))
        shared = (n_prompt - 1) // nb * nb if backend == "cuda" else n_prompt - 1
        assert texts == {0: ANSWER[:12], 1: ANSWER[:12]}
        assert [c[2] for c in pipe.copies] == [shared]
        # each choice's own prefill: from the shared end to the prompt's end, in one step
        own = [(pos, rows) for pos, rows, _ in pipe.steps if pos == shared]
        assert own == [(shared, n_prompt - shared)] * 2, own
