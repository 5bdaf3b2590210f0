"""One failing request never fails the others in its batch (issue #17, finding 6), on a
real model: SmolLM2 in llama.cpp behind the real LocalPipeline, ModelServer and
scheduler. Two requests decode together (one engine call per step); the sampler is made
to fail on purpose for one of them (its seed marks it). That request fails with its own
500 engine_failed; the other completes with exactly the greedy tokens it gives alone.
The split path (a DataError for one session of a batch) is in tests/test_split_runtime.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from meshnode.mesh.final import FinalSampler, Sampling
from meshnode.mesh.pipeline import LocalPipeline, StepFailedError
from meshnode.serve.client import GenerationRequest
from meshnode.serve.errors import error_spec
from meshnode.serve.model_server import ModelServer, ServeSettings
from inproc import collect

pytestmark = pytest.mark.slow

POISON_SEED = 666
N_CTX, N_NEW = 512, 24


def test_a_request_whose_sampling_fails_does_not_fail_its_neighbour(smollm2, monkeypatch):
    from meshnode.engine import EngineConfig
    from meshnode.engine.tokenizer import Tokenizer
    from meshnode.engine.worker import EngineWorker

    real = FinalSampler.finalize
    sampled: dict[int, int] = {}
    batched: list[int] = []   # sessions per finalize call of the poisoned request

    def finalize(self, session, logits, drafts, sampling: Sampling, *rest):
        if sampling.seed == POISON_SEED:
            sampled[session] = sampled.get(session, 0) + 1
            if sampled[session] >= 4:     # a few tokens beside the other request first
                raise ValueError("sampling poisoned on purpose")
        return real(self, session, logits, drafts, sampling, *rest)

    monkeypatch.setattr(FinalSampler, "finalize", finalize)

    async def main():
        worker = await EngineWorker.load(EngineConfig(smollm2.path, n_ctx=N_CTX, n_batch=64, n_seq_max=2,
                                                      n_threads=2))
        pipe = LocalPipeline(worker)
        calls = []
        run = pipe.run

        async def counting(steps):
            calls.append(len(steps))
            return await run(steps)

        pipe.run = counting
        server = ModelServer(ServeSettings("m", n_ctx=N_CTX, parallel=2), Tokenizer(smollm2.path), pipe)
        try:
            good = GenerationRequest("good", "m", prompt="The capital of France is", max_tokens=N_NEW,
                                     temperature=0.0)
            bad = replace(good, request_id="bad", prompt="Once upon a time, in a small village,",
                          seed=POISON_SEED)
            alone = await collect(server, good)
            together = await asyncio.gather(collect(server, good), collect(server, bad))
        finally:
            await server.close()
        return calls, alone, together

    calls, alone, (good, bad) = asyncio.run(main())
    assert isinstance(alone, str) and alone
    assert max(calls) == 2                      # the two requests shared engine calls
    assert good == alone                        # untouched by its neighbour's failure
    assert isinstance(bad, StepFailedError) and "poisoned on purpose" in str(bad)
    assert error_spec(bad)[:3] == (500, "server_error", "engine_failed")
