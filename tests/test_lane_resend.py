"""Which path stage 0 sends a step on (meshnode.mesh.pipeline).

A step never takes the lane past stream frames of its session that no reply has followed:
a prompt whose last chunk is one row would otherwise overtake its earlier chunks, still
crossing the stream, and fail at the next stage (seen on a GPU split, where stages
compute a lane step the moment it lands).

When stage 0 resends a fast-lane step over the stream: after
max(LANE_RETRY_MIN_S, 8 round trips of decode steps). A model whose steps take longer
than the minimum (a big model on CPUs) must not have its lane steps resent for being slow:
each resend computes the step again on every stage, and two of them switch the lane off.

Pure logic: a fake fabric and a fake final stage that answers each step after a delay."""

from __future__ import annotations

import asyncio

import numpy as np

import meshnode.mesh.pipeline as pipeline_mod
from meshnode import wire
from meshnode.mesh.pipeline import MeshPipeline, Step

STEP_S = 0.1          # how long the later stages take per step


class _Worker:
    async def forward(self, segs, rewind=False):
        return [np.zeros((s.n_rows, 4), dtype=np.float32) for s in segs]


class _Fabric:
    """A lane that can be switched on; every frame reaches a final stage that answers
    ``STEP_S`` later with one token per step."""

    def __init__(self) -> None:
        self.lane = False
        self.pipe: MeshPipeline | None = None
        self.on_lane = self.on_stream = self.missed = 0

    def lane_ready(self, node: str) -> bool:
        return self.lane

    def send_lane(self, node: str, msg) -> bool:
        self.on_lane += 1
        self._answer(msg)
        return True

    async def send_data(self, node: str, msg, key) -> None:
        self.send_data_now(node, msg, key)

    def send_data_now(self, node: str, msg, key) -> None:
        self.on_stream += 1
        self._answer(msg)

    def lane_missed(self, node: str) -> None:
        self.missed += 1

    def _answer(self, msg) -> None:
        frame = wire.decode(bytes(msg) if isinstance(msg, (bytes, bytearray, memoryview)) else wire.encode(msg))
        if not isinstance(frame, wire.Forward):
            return
        reply = wire.TokenReturn(ref=0, batch_id=frame.batch_id, results=tuple(
            wire.SegmentResult(session=s.session, tokens=(7,), n_accepted=0, n_drafted=0)
            for s in frame.segments))
        asyncio.get_running_loop().call_later(STEP_S, self.pipe.on_data, "final", reply)


def test_a_slow_model_lane_steps_are_not_resent(monkeypatch):
    monkeypatch.setattr(pipeline_mod, "LANE_RETRY_MIN_S", STEP_S / 4)   # slower than the minimum

    async def main():
        fabric = _Fabric()
        pipe = fabric.pipe = MeshPipeline(_Worker(), fabric, ["final"])
        pos = 0
        for lane_on in (False, False, False, True, True, True):
            fabric.lane = lane_on   # the first steps go over the stream while the lane is probed
            (res,) = await pipe.run([Step(1, pos, np.asarray([5], dtype=np.int32))])
            assert res.tokens == (7,)
            pos += 1
        return fabric, pipe

    fabric, pipe = asyncio.run(main())
    assert pipe.lane_steps == 3 and fabric.on_lane == 3
    assert pipe.lane_resends == 0 and fabric.missed == 0 and fabric.on_stream == 3


def test_a_prompts_one_row_last_chunk_stays_behind_its_earlier_chunks():
    async def main():
        fabric = _Fabric()
        fabric.lane = True
        pipe = fabric.pipe = MeshPipeline(_Worker(), fabric, ["final"])
        # a 65-token prompt: a chunk of 64 wanting nothing back, then its last row
        assert await pipe.run([Step(1, 0, np.zeros(64, dtype=np.int32), n_logits=0)]) == [None]
        (first,) = await pipe.run([Step(1, 64, np.asarray([5], dtype=np.int32))])
        assert first.tokens == (7,)
        assert (fabric.on_stream, fabric.on_lane) == (2, 0)   # the last row took the stream too
        await pipe.run([Step(1, 65, np.asarray([7], dtype=np.int32))])
        assert (fabric.on_stream, fabric.on_lane) == (2, 1)   # a reply came: the lane again
        # another session's decode steps are not held back by this one's chunks
        await pipe.run([Step(2, 0, np.zeros(8, dtype=np.int32), n_logits=0)])
        await pipe.run([Step(1, 66, np.asarray([7], dtype=np.int32))])
        assert fabric.on_lane == 2

    asyncio.run(main())
