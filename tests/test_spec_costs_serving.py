"""What the serving loop teaches the cost model: the steps that had the route to themselves.

Pure logic: the oracle pipeline of tests/test_lookahead_serving.py on one "stage" whose call
takes five times as long when it carries several requests' steps or waits behind another
call, as a real node's does under a burst. The scheduler, proposer, policy, window and
cost model are the real ones.
"""

from __future__ import annotations

import asyncio

from meshnode.serve.client import ChatMessage, GenerationRequest
from meshnode.serve.model_server import ModelServer, ServeSettings
from char_tokenizer import CharTokenizer
from inproc import answer
from test_lookahead_serving import ANSWER, CODE, OraclePipeline, _spec

BASE_S = 0.02    # a lone step; long enough that a loaded machine's jitter stays well below 1.5 of it
CROWD = 5


class _CrowdPipeline(OraclePipeline):
    n_stages = 1

    def __init__(self, truth: list[int]) -> None:
        super().__init__(truth, BASE_S)
        self.crowded = 0

    async def run(self, steps):
        crowded = len({s.session for s in steps}) > 1 or self.in_flight > 0
        self.crowded += crowded
        self.delay = BASE_S * (CROWD if crowded else 1)   # read before run's first await
        return await super().run(steps)


def test_a_burst_of_other_requests_does_not_teach_the_cost_model_its_load():
    tok = CharTokenizer()

    def request(i: int) -> GenerationRequest:
        return GenerationRequest(f"r{i}", "m", messages=(ChatMessage("user", CODE),), max_tokens=60,
                                 temperature=0.0)

    async def main():
        pipe = _CrowdPipeline(tok.encode(CODE) + tok.encode(ANSWER))
        server = ModelServer(ServeSettings("m", n_ctx=1024, spec=_spec("on")), tok, pipe)
        cost = server._decoder.cost
        alone = await answer(server, request(0))
        learned = cost.observed
        crowded_before = pipe.crowded
        burst = await asyncio.gather(*(answer(server, request(i)) for i in range(1, 4)))
        await server.scheduler.close()
        return alone, burst, learned, cost.observed, pipe.crowded - crowded_before

    alone, burst, learned, after, crowded = asyncio.run(main())
    assert alone[0] == ANSWER[:60] and all(text == ANSWER[:60] for text, _ in burst)
    assert crowded > 10                                   # the burst's calls were crowded
    assert 0 in learned and any(k >= 1 for k in learned)  # plain steps and windows, alone
    # every cost still what a lone step of that shape takes, nowhere near the burst's 5x
    assert all(s < 2.5 * BASE_S for s in after.values()), after
