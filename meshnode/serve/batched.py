"""A batch of prompts in one completions request, as one stream of events.

OpenAI's ``/v1/completions`` takes a list of prompts (lm-eval and other evaluation
scripts send their requests that way); the answer has ``n`` choices per prompt, choice
``j`` of prompt ``i`` at index ``i * n + j``. :func:`batched_events` runs each prompt as
its own engine request, a few at a time (each holds sequence slots like any request, so
a batch of a thousand prompts neither fills the node's queue nor is refused with 429 for
its size), and merges their events into what one request with ``len(prompts) * n``
choices would give: one :class:`Admitted`, then the choices' deltas and ``Finished``
events, re-indexed. The first failure of any prompt fails the batch (raised where the
merged stream is, so before the first event for the prompts that start first).

Scored prompts (``echo`` with logprobs: an evaluation harness's log-likelihoods) often
share a long context, one prompt per answer choice, sorted next to each other. Started
together, each would compute that context; so a scored prompt that shares at least
:data:`LEAD_CHARS` characters (or :data:`~meshnode.serve.prefix_cache.MIN_PREFIX` token
ids) with one of the last few prompts that lead waits until that leader is done, and
then takes the context's KV and scores from the prefix cache (serve/prefix_cache.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from os.path import commonprefix

from meshnode.serve.client import Admitted, EngineClient, GenerationEvent, GenerationRequest
from meshnode.serve.prefix_cache import MIN_PREFIX

# Prompts of one batch generating at once: enough to keep a node's batch scheduler fed
# (prompts of one batch decode side by side), few enough to leave slots to other clients.
PROMPTS_AT_ONCE = 4

# A shared text prefix worth waiting for a leader (at a few characters per token, about
# the prefix cache's MIN_PREFIX tokens); token-id prompts compare MIN_PREFIX ids.
LEAD_CHARS = 4 * MIN_PREFIX


def leaders(requests: Sequence[GenerationRequest], recent: int = PROMPTS_AT_ONCE) -> list[int | None]:
    """For each prompt, the earlier prompt it waits for (module docstring), or None. Only
    scored single-choice prompts wait; each is compared with the last ``recent`` leaders
    (a harness sorts prompts of one context together), so a batch costs O(len * recent)."""
    out: list[int | None] = []
    roots: list[int] = []
    for p, r in enumerate(requests):
        lead = None
        if r.echo and r.logprobs is not None and r.n == 1:
            lead = next((q for q in reversed(roots[-recent:]) if _shares_context(requests[q], r)), None)
        out.append(lead)
        if lead is None:
            roots.append(p)
    return out


def _shares_context(a: GenerationRequest, b: GenerationRequest) -> bool:
    if a.prompt is not None and b.prompt is not None:
        return len(commonprefix([a.prompt, b.prompt])) >= LEAD_CHARS
    if a.prompt_ids is not None and b.prompt_ids is not None:
        return len(commonprefix([a.prompt_ids, b.prompt_ids])) >= MIN_PREFIX
    return False


async def batched_events(client: EngineClient, requests: Sequence[GenerationRequest],
                         at_once: int = PROMPTS_AT_ONCE) -> AsyncIterator[GenerationEvent]:
    """The events of ``requests`` (the prompts of one batch, each with ``n`` choices),
    merged and re-indexed; closing the iterator cancels every prompt still running (their
    engine iterators are closed, so the engine frees their sessions)."""
    queue: asyncio.Queue[tuple[int, GenerationEvent | Exception | None]] = asyncio.Queue()
    tasks: list[asyncio.Task] = []
    leads = leaders(requests, at_once)
    done = [asyncio.Event() for _ in requests]

    async def run(p: int) -> None:
        lead = leads[p]
        if lead is not None:
            await done[lead].wait()
        try:
            await generate(p)
        finally:
            done[p].set()

    async def generate(p: int) -> None:
        events = client.generate(requests[p])
        try:
            async for event in events:
                queue.put_nowait((p, event))
        except Exception as exc:  # noqa: BLE001 - handed to the merged stream, which raises it
            queue.put_nowait((p, exc))
        finally:
            await events.aclose()   # type: ignore[attr-defined]
        queue.put_nowait((p, None))

    def start_next() -> None:
        if len(tasks) < len(requests):
            tasks.append(asyncio.create_task(run(len(tasks))))

    for _ in range(min(at_once, len(requests))):
        start_next()
    admitted, left = False, len(requests)
    try:
        while left:
            p, event = await queue.get()
            if event is None:          # this prompt is done: the next one starts
                left -= 1
                start_next()
            elif isinstance(event, Exception):
                raise event
            elif isinstance(event, Admitted):
                if not admitted:
                    admitted = True
                    yield event
            else:
                yield replace(event, index=p * requests[p].n + event.index)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
