"""meshnode.serve.batched: which prompts of a batch wait for a leader, and that they
start only once it is done (pure logic, a fake engine client)."""

from __future__ import annotations

import asyncio

from meshnode.serve.batched import LEAD_CHARS, batched_events, leaders
from meshnode.serve.client import Admitted, Finished, GenerationRequest, TextDelta, Usage
from meshnode.serve.prefix_cache import MIN_PREFIX

CONTEXT = "x" * LEAD_CHARS


def _req(i: int, prompt: str | None = None, ids: tuple[int, ...] | None = None, *, echo: bool = True,
         logprobs: int | None = 1, n: int = 1) -> GenerationRequest:
    return GenerationRequest(f"r{i}", "m", prompt=prompt, prompt_ids=ids, echo=echo, logprobs=logprobs, n=n,
                             max_tokens=1)


def test_scored_prompts_sharing_a_context_wait_for_its_first_prompt():
    reqs = [_req(0, CONTEXT + " A"), _req(1, CONTEXT + " B"), _req(2, "other" * 40), _req(3, CONTEXT + " C"),
            _req(4, "other" * 40 + "!"), _req(5, CONTEXT[:-1] + "y")]
    assert leaders(reqs) == [None, 0, None, 0, 2, None]   # 5 shares one character too few


def test_token_id_prompts_compare_ids():
    ctx = tuple(range(MIN_PREFIX))
    reqs = [_req(0, ids=ctx + (1,)), _req(1, ids=ctx + (2,)), _req(2, ids=ctx[:-1] + (9, 9))]
    assert leaders(reqs) == [None, 0, None]


def test_only_scored_single_choice_prompts_wait():
    for kw in ({"echo": False}, {"logprobs": None}, {"n": 2}):
        reqs = [_req(0, CONTEXT + " A", **kw), _req(1, CONTEXT + " B", **kw)]
        assert leaders(reqs) == [None, None], kw


def test_a_leader_is_one_of_the_last_few():
    reqs = [_req(0, CONTEXT)] + [_req(i, f"{i:03d}" * 50) for i in range(1, 6)] + [_req(6, CONTEXT + "!")]
    assert leaders(reqs, recent=4)[-1] is None
    assert leaders(reqs, recent=6)[-1] == 0


class _Client:
    """Each prompt's request: Admitted, one delta, Finished, with a log of when it ran."""

    def __init__(self) -> None:
        self.log: list[str] = []

    async def generate(self, req: GenerationRequest):
        self.log.append(f"start {req.request_id}")
        yield Admitted(3)
        await asyncio.sleep(0.01)
        yield TextDelta(req.request_id)
        self.log.append(f"end {req.request_id}")
        yield Finished("length", Usage(3, 1))


def test_followers_start_after_their_leader_and_the_batch_keeps_its_order():
    reqs = [_req(0, CONTEXT + " A"), _req(1, CONTEXT + " B"), _req(2, CONTEXT + " C"), _req(3, "other" * 40)]
    client = _Client()

    async def run() -> list:
        return [e async for e in batched_events(client, reqs)]

    events = asyncio.run(run())
    assert client.log.index("end r0") < client.log.index("start r1")
    assert client.log.index("end r0") < client.log.index("start r2")
    assert client.log.index("start r3") < client.log.index("end r0")   # no shared context: at once
    assert sum(isinstance(e, Admitted) for e in events) == 1
    assert sorted(e.text for e in events if isinstance(e, TextDelta)) == ["r0", "r1", "r2", "r3"]
    assert sorted(e.index for e in events if isinstance(e, Finished)) == [0, 1, 2, 3]
