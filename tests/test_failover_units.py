"""Failover logic without processes: the re-plan ladder, the replay schedule, the route
gate, the scheduler's route switch, and the real ModelServer loop failing over between
two fake pipelines mid-generation (greedy text must continue exactly).

The fake pipelines are tests/test_lookahead_serving.py's OraclePipeline: its "model"
continues the true text only from a KV that holds exactly the true text so far, and it
refuses a step that starts past its session's KV (a gap). So a session that were not
replayed on the new route, or replayed wrongly, could not produce the same answer.
Real processes, llama.cpp and QUIC: tests/test_failover.py.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from meshnode.limits import MAX_VERIFY_WINDOW
from meshnode.mesh.pipeline import PipelineUnavailableError, Step, StepFailedError
from meshnode.mesh.planner import Candidate, Plan, PlannedStage
from meshnode.mesh.replan import fallback_options, substitute, upgrade_wanted
from meshnode.mesh.runtime import ServeOptions
from meshnode.serve.client import ChatMessage, GenerationRequest, TextDelta
from meshnode.serve.errors import EngineUnavailableError
from meshnode.mesh.final import Counts, Sampling
from meshnode.serve.failover import RouteGate, replay_steps
from meshnode.serve.model_server import ModelServer, ServeSettings
from meshnode.serve.scheduler import BatchScheduler
from char_tokenizer import CharTokenizer
from test_lookahead_serving import ANSWER, CODE, OraclePipeline, _spec

# ---- the re-plan ladder ------------------------------------------------------------------


def test_fallback_options_relax_a_forced_layout_step_by_step():
    base = ServeOptions(split=4)
    ladder = fallback_options(base)
    assert ladder[0] is base
    assert [o.split for o in ladder] == [4, 3, 2, None]
    assert all(o.explicit is None for o in ladder)
    explicit = ServeOptions(explicit="a=0:10,b=10:30")
    assert [(o.explicit, o.split) for o in fallback_options(explicit)] == [("a=0:10,b=10:30", None), (None, None)]
    auto = ServeOptions()
    assert fallback_options(auto) == [auto]


def _plan(*stages: tuple[str, int, int]) -> Plan:
    return Plan(tuple(PlannedStage(n, n, a, b, 0) for n, a, b in stages), "test")


def test_upgrade_only_when_the_route_changes():
    two = _plan(("a", 0, 15), ("b", 15, 30))
    assert not upgrade_wanted(two, _plan(("a", 0, 15), ("b", 15, 30)))
    assert upgrade_wanted(two, _plan(("a", 0, 10), ("b", 10, 20), ("c", 20, 30)))
    assert upgrade_wanted(two, _plan(("a", 0, 15), ("c", 15, 30)))
    assert upgrade_wanted(None, two)


def test_substitute_keeps_the_ranges_and_moves_lost_stages_to_a_spare_that_fits():
    plan = Plan((PlannedStage("a", "a", 0, 10, 100), PlannedStage("b", "b", 10, 20, 100),
                 PlannedStage("c", "c", 20, 30, 100)), "test")
    coord = Candidate("a", "a", 10**9, is_coordinator=True)
    small, big = Candidate("d", "d", 105), Candidate("e", "e", 500)
    fits, other_fits = Candidate("f", "f", 200), Candidate("g", "g", 200)
    # b is gone: the spare with room takes [10, 20); the others keep their stage
    got = substitute(plan, [coord, Candidate("c", "c", 0), small, big])
    assert [(s.node_id, s.start, s.end) for s in got.stages] == [("a", 0, 10), ("e", 10, 20), ("c", 20, 30)]
    # two lost stages, two spares: deterministic (most room, then node id), never the same spare twice
    got = substitute(plan, [coord, other_fits, fits])
    assert [s.node_id for s in got.stages] == ["a", "f", "g"]
    assert substitute(plan, [coord, small]) is None          # 100 + 10% headroom > 105
    assert substitute(plan, [coord, big]) is None            # one spare for two stages
    assert substitute(plan, [Candidate("x", "x", 10**9, is_coordinator=True), big, fits]) is None
    intact = [coord, Candidate("b", "b", 0), Candidate("c", "c", 0)]
    assert substitute(plan, intact) is plan
    # moved again and again (a failover every few minutes): the reason names the last move
    again = substitute(substitute(plan, [coord, Candidate("c", "c", 0), big]),
                       [coord, Candidate("e", "e", 0), fits])
    assert again.reason == "test; ranges kept, lost stages moved (c -> f)"


# ---- the replay schedule -----------------------------------------------------------------


def test_replay_uses_the_cold_prefill_chunks_then_small_chunks():
    prompt, generated = list(range(150)), list(range(1000, 1070))
    steps = replay_steps(7, prompt + generated, len(prompt), 64)
    # the prompt as its cold prefill cut it
    assert [(s.pos, len(s.tokens)) for s in steps[:3]] == [(0, 64), (64, 64), (128, 22)]
    rest = steps[3:]
    assert all(len(s.tokens) <= MAX_VERIFY_WINDOW for s in rest)
    assert rest[0].pos == 150
    # contiguous, complete, in order, no logits wanted
    got = np.concatenate([s.tokens for s in steps]).tolist()
    assert got == prompt + generated
    assert all(a.pos + len(a.tokens) == b.pos for a, b in zip(steps, steps[1:]))
    assert all(s.n_logits == 0 and s.session == 7 for s in steps)
    checked = replay_steps(7, prompt + generated, len(prompt), 64, check_last=True)
    assert [s.n_logits for s in checked] == [0] * (len(checked) - 1) + [1]
    # a penalized request's check is penalized by the answer so far, as the lost step was
    penalized = replay_steps(7, prompt + [5, 9, 5], len(prompt), 64, check_last=True,
                             sampling=Sampling(frequency=1.0))
    assert penalized[-1].seen == Counts((5, 9), (2, 1)) and checked[-1].seen == Counts()


def test_replay_takes_the_chunks_the_new_route_computes_exactly():
    """On a route with a GPU stage the generated tokens go in chunks no wider than
    ``rows_at`` says at their start (its exact window, cut at KV buckets), so the replayed
    KV equals what one-row steps and exact windows computed there."""
    from meshnode.limits import gpu_bucket_drafts

    def rows_at(pos: int) -> int:   # a GPU stage at pad 2: 4 rows, within a bucket
        return min(4, 1 + gpu_bucket_drafts(pos, 2))

    prompt, generated = list(range(1000)), list(range(5000, 5040))
    steps = replay_steps(3, prompt + generated, len(prompt), 256, rows_at=rows_at)
    rest = [s for s in steps if s.pos >= len(prompt)]
    assert [(s.pos, len(s.tokens)) for s in rest[:8]] == [
        (1000, 4), (1004, 4), (1008, 4), (1012, 4), (1016, 4), (1020, 3), (1023, 4), (1027, 4)]
    assert all(len(s.tokens) <= rows_at(s.pos) for s in rest)
    assert np.concatenate([s.tokens for s in steps]).tolist() == prompt + generated
    # a bound that says 0 or less still makes progress, one row at a time
    assert all(len(s.tokens) == 1 for s in replay_steps(3, [1, 2, 3, 4], 1, 64, rows_at=lambda p: 0)[1:])


def test_replay_of_a_prompt_only_and_bad_histories():
    steps = replay_steps(1, [5, 6, 7], 3, 2, check_last=True)
    assert [(s.pos, s.tokens.tolist(), s.n_logits) for s in steps] == [(0, [5, 6], 0), (2, [7], 1)]
    with pytest.raises(ValueError):
        replay_steps(1, [1, 2], 3, 64)
    with pytest.raises(ValueError):
        replay_steps(1, [1, 2], 0, 64)


# ---- the route gate ----------------------------------------------------------------------


def test_route_gate_waits_for_the_new_route_or_fails_fast():
    async def main():
        gate = RouteGate()
        assert not gate.changed_since(0)
        gate.lost("stage 1 gone")
        assert gate.changed_since(0)
        waiter = asyncio.ensure_future(gate.wait_up(5.0))
        await asyncio.sleep(0.01)
        assert not waiter.done() and gate.waiting == 1
        gate.restored()
        assert await waiter == 1 and gate.waiting == 0
        assert not gate.changed_since(1) and gate.changed_since(0)
        # no route: a waiter fails at once, with the reason
        gate.lost("again")
        waiter = asyncio.ensure_future(gate.wait_up(5.0))
        await asyncio.sleep(0.01)
        t0 = asyncio.get_running_loop().time()
        gate.failed("no plan fits")
        with pytest.raises(PipelineUnavailableError, match="no plan fits"):
            await waiter
        assert asyncio.get_running_loop().time() - t0 < 0.1
        # a loss declared a moment after the step saw the link gone
        gate2 = RouteGate()
        asyncio.get_running_loop().call_later(0.05, gate2.lost, "late")
        assert await gate2.wait_lost(0, 2.0)
        assert not await RouteGate().wait_lost(0, 0.05)   # never declared: the error stands

    asyncio.run(main())


# ---- the scheduler's route switch ----------------------------------------------------------


def test_scheduler_fails_steps_meant_for_the_old_route():
    async def main():
        old, new = OraclePipeline([1] * 10), OraclePipeline([1] * 10)
        sched = BatchScheduler(old)
        sched.enter(3)   # a decoding session the batch waits for: the step is not taken yet
        stuck = sched.enqueue(Step(1, 0, np.asarray([1], dtype=np.int32)))
        sched.set_pipeline(new)
        assert sched.epoch == 1
        with pytest.raises(PipelineUnavailableError):
            await stuck
        late = sched.enqueue(Step(1, 3, np.asarray([1], dtype=np.int32)), epoch=0)
        with pytest.raises(PipelineUnavailableError):
            await late
        ok = await sched.submit(Step(2, 0, np.asarray([1, 1], dtype=np.int32), 1), epoch=1)
        assert ok is not None and new.kv[2] == [1, 1] and 2 not in old.kv
        await sched.close()

    asyncio.run(main())


# ---- the model server failing over mid-generation ---------------------------------------------


class DyingPipeline(OraclePipeline):
    """An OraclePipeline whose route dies after ``die_after`` decode steps: the gate goes
    down first (as the coordinator's hook does), then every step fails as unavailable."""

    def __init__(self, truth: list[int], gate_of, die_after: int) -> None:
        super().__init__(truth)
        self.gate_of = gate_of
        self.die_after = die_after
        self.dead = False

    async def run(self, steps):
        if self.dead:
            raise PipelineUnavailableError("pipeline closed")
        if sum(1 for _, rows, k in self.steps if rows == k + 1 and rows <= 17) >= self.die_after:
            self.dead = True
            self.gate_of().lost("stage 1 on b: link lost")
            await asyncio.sleep(0.001)
            raise PipelineUnavailableError("stage 1 on b: link lost")
        return await super().run(steps)


async def _failover_run(spec, die_after: int, *, outcome: str = "restored", n_batch: int = 16):
    truth = CharTokenizer().encode(CODE) + CharTokenizer().encode(ANSWER)
    server: ModelServer | None = None
    old = DyingPipeline(truth, lambda: server.route, die_after)
    server = ModelServer(ServeSettings("m", n_ctx=1024, n_batch=n_batch, spec=spec), CharTokenizer(), old)
    new = OraclePipeline(truth)

    async def replan():
        while not old.dead:
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.05)   # the re-plan takes a while; requests wait
        if outcome == "restored":
            server.switch_pipeline(new)
        else:
            server.route.failed("no plan fits the members that remain")

    task = asyncio.ensure_future(replan())
    req = GenerationRequest("r1", "m", messages=(ChatMessage("user", CODE),), max_tokens=len(ANSWER),
                            temperature=0.0)
    text, error = "", None
    try:
        async for ev in server.generate(req):
            if isinstance(ev, TextDelta):
                text += ev.text
    except EngineUnavailableError as exc:
        error = exc
    if not old.dead:    # the answer ended first (windows make fewer steps): no failover
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await server.scheduler.close()
    return old, new, server, text, error


@pytest.mark.parametrize("spec", [None, "on"])
@pytest.mark.parametrize("die_after", [0, 1, 7, 25])
def test_a_stream_continues_exactly_on_the_new_route(spec, die_after):
    old, new, server, text, error = asyncio.run(_failover_run(_spec(spec) if spec else None, die_after))
    assert error is None
    assert text == ANSWER                       # nothing lost, nothing repeated
    assert old.dead
    assert server.replay_mismatches == 0 and len(server.resumed) <= 1
    # the new route got the session's history first (checked for gaps by the fake)
    # and the prompt in the cold prefill's chunks
    prompt_chunks = [(pos, rows) for pos, rows, _ in new.steps if pos < len(CODE)]
    assert prompt_chunks == [(p, min(16, len(CODE) - p)) for p in range(0, len(CODE), 16)]
    # the session was freed on the new route, or kept there for prefix reuse
    assert set(new.kv) <= set(server.prefix.sessions()) and server.prefix.capacity


def test_no_route_ends_the_stream_with_the_reason():
    old, new, server, text, error = asyncio.run(_failover_run(None, 5, outcome="failed"))
    assert isinstance(error, EngineUnavailableError) and "no plan fits" in str(error)
    assert ANSWER.startswith(text) and len(text) >= 5   # what was produced before stays
    assert not new.steps


# ---- what status and the TUI show ----------------------------------------------------------


def test_status_json_and_the_status_bar_show_the_failover():
    import dataclasses

    from meshnode.serve.node_routes import status_json
    from meshnode.state import FailoverInfo, ModelStatus
    from tests.fake_node import make_snapshot
    from ui.widgets.status_bar import service_status

    info = FailoverInfo(1.7e9, "lost", "stage 1 (b): link lost", 2, 2, 8699.0, 1)
    snap = dataclasses.replace(make_snapshot(), status=ModelStatus.READY, status_detail="2 stage(s)",
                               failovers=(info,))
    data = status_json(snap)
    assert data["status"] == "ready" and data["status_detail"] == "2 stage(s)"
    assert data["failovers"] == [dict(t=1.7e9, cause="lost", reason="stage 1 (b): link lost", stages_before=2,
                                      stages_after=2, resume_ms=8699.0, requests=1)]
    glyph, text, style = service_status(snap)
    assert "re-planned 1×" in text and "8.7 s" in text and style == "green"
    recovering = dataclasses.replace(snap, status=ModelStatus.RECOVERING, status_detail="stage 1 (b): link lost")
    glyph, text, style = service_status(recovering)
    assert text == "recovering · stage 1 (b): link lost" and style == "yellow"


def test_requests_after_a_failover_run_on_the_new_route_with_several_choices_too():
    """Every kind of request sends its steps on the route it prefilled on, also once the
    route has changed before it started: a request with n choices (shared prefill) too."""
    async def main():
        truth = CharTokenizer().encode(CODE) + CharTokenizer().encode(ANSWER)
        old, new = OraclePipeline(truth), OraclePipeline(truth)
        server = ModelServer(ServeSettings("m", n_ctx=1024, n_batch=16), CharTokenizer(), old)
        server.route.lost("stage 1 on b: link lost")
        server.switch_pipeline(new)
        texts = {}
        for n in (1, 2):
            req = GenerationRequest(f"r{n}", "m", messages=(ChatMessage("user", CODE),), max_tokens=20,
                                    temperature=0.0, n=n)
            got: dict[int, str] = {}
            async for ev in server.generate(req):
                if isinstance(ev, TextDelta):
                    got[ev.index] = got.get(ev.index, "") + ev.text
            texts[n] = got
        await server.scheduler.close()
        return old, new, texts

    old, new, texts = asyncio.run(main())
    assert texts[1] == {0: ANSWER[:20]}
    assert texts[2] == {0: ANSWER[:20], 1: ANSWER[:20]}
    assert not old.steps and new.steps


async def _answer_across(routes) -> tuple[ModelServer, str]:
    """Stream the answer to CODE on ``routes(gate)``'s first pipeline; each dying one is
    replaced by the next once it died (a re-plan of 20 ms)."""
    server: ModelServer | None = None
    chain = routes(lambda: server.route)
    server = ModelServer(ServeSettings("m", n_ctx=1024, n_batch=16), CharTokenizer(), chain[0])

    async def replan():
        for dying, nxt in zip(chain, chain[1:]):
            while not dying.dead:
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.02)
            server.switch_pipeline(nxt)

    task = asyncio.ensure_future(replan())
    req = GenerationRequest("r1", "m", messages=(ChatMessage("user", CODE),), max_tokens=len(ANSWER),
                            temperature=0.0)
    text = ""
    async for ev in server.generate(req):
        if isinstance(ev, TextDelta):
            text += ev.text
    await asyncio.wait_for(task, 5)
    await server.scheduler.close()
    return server, text


TRUTH = CharTokenizer().encode(CODE) + CharTokenizer().encode(ANSWER)


def test_a_route_lost_again_during_the_replay_resumes_on_the_next_one():
    """The second loss hits the replay itself (its first chunk): the request waits for the
    third route and replays there, rather than failing with the second loss."""
    chain = []

    def routes(gate):
        chain.extend([DyingPipeline(TRUTH, gate, 7),
                      DyingPipeline(TRUTH, gate, 0),     # dies at its first call: the replay
                      OraclePipeline(TRUTH)])
        return chain

    server, text = asyncio.run(_answer_across(routes))
    first, second, third = chain
    assert first.dead and second.dead
    assert text == ANSWER
    assert server.route.epoch == 2 and len(server.resumed) == 1   # resumed once, on the third route
    assert third.steps[0][0] == 0      # the third route got the whole history from position 0


class RefusingPipeline(DyingPipeline):
    """A route whose loss shows as a stage refusing the session's step (a StepFailedError
    in its place, as when the step reached a stage of the new route without its KV)."""

    async def run(self, steps):
        try:
            return await super().run(steps)
        except PipelineUnavailableError:
            return [StepFailedError(s.session, "position 38 given, 0 expected") for s in steps]


def test_a_step_refused_while_the_route_changes_resumes_the_session():
    server, text = asyncio.run(_answer_across(lambda gate: [RefusingPipeline(TRUTH, gate, 5),
                                                             OraclePipeline(TRUTH)]))
    assert text == ANSWER and len(server.resumed) == 1
