"""Pipelines: how stage 0 pushes a batch of steps through the stages of a model.

A *step* is some rows of one session: a prefill chunk (``n_logits == 0`` unless it is
the last chunk), a decode step (one row, ``n_logits == 1``) or a verify window
(``[last, d1..dk]``, ``n_logits == k + 1``). A pipeline runs a batch of steps of
different sessions through every stage and returns, per step that wanted logits, the
final stage's :class:`~meshnode.mesh.final.Finalized` tokens.

* :class:`LocalPipeline`: one node, whole model; forward and finalize on one thread.
* :class:`MeshPipeline`: stage 0 runs its slice locally, sends the hidden states to
  stage 1 as one ``Forward`` frame; each stage forwards to the next; the final stage
  samples/verifies and sends ``TokenReturn`` straight back to stage 0.

Rejected draft rows are never trimmed by a separate message: the next step of that
session starts at an earlier position and every stage rewinds its KV to it first.
Steps that want no logits (non-final prefill chunks) return at once once sent, which is
what lets stage 0 compute chunk i+1 while stage 1 works on chunk i.

This is the data plane between stages, so it lives in the mesh beside the stage host
(:mod:`meshnode.mesh.stage_host`, stages 1..n-1); the serving layer drives it through
its scheduler. A failure is a :class:`PipelineUnavailableError` (no route right now:
retry later) or a :class:`PipelineFailedError` (a stage failed computing the step); the
serving layer maps them to its own errors.

Failures are as wide as their cause. An engine call that fails (stage 0's, or any
stage's ``DataError`` for the whole batch) fails every step of the batch: ``run`` raises.
A session whose sampling fails at the final stage fails alone: ``run`` returns a
:class:`StepFailedError` in that step's place and the other steps' tokens beside it
(docs/protocol.md, "Data": a ``DataError`` naming one session of the batch).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from meshnode import wire
from meshnode.engine import EngineError, Segment
from meshnode.engine.worker import EngineWorker
from meshnode.errors import MeshnodeError
from meshnode.mesh.fabric_api import Fabric
from meshnode.mesh.final import (
    GREEDY, NO_COUNTS, Counts, FinalSampler, Finalized, Sampling, SamplingFailed, segment_fields,
)
from meshnode.mesh.logprobs import TokenLogprobs
from meshnode.wire.messages import WHOLE_BATCH

log = logging.getLogger(__name__)

DATA_STREAM = "data"
# A step sent with SEG_LANE whose reply has not come after this long (or 8 round trips of
# decode steps, if longer) is sent again over the QUIC stream: a lane frame may be lost.
# Long enough that a step queued behind another session's prefill chunk is not resent.
# The round trips are those of every decode step, the stream's too: a model whose steps
# take more than a second (a big model on CPUs) has its first decode steps go over the
# stream while the lane is probed, so its first lane step is not resent (computed twice
# on every stage) for being slow, and its lane is not switched off for it.
LANE_RETRY_MIN_S = 1.0
LANE_RETRY_RTTS = 8


class PipelineUnavailableError(MeshnodeError):
    """No route to the model's stages right now (closed, a stage unreachable or silent):
    a later request may succeed."""


class PipelineFailedError(MeshnodeError):
    """A stage failed while computing a step."""


class StepFailedError(PipelineFailedError):
    """One session's step failed at the final stage (its sampling); the other steps of
    its batch got their tokens. Returned in that step's place by :meth:`Pipeline.run`,
    so that only this session's request fails."""

    def __init__(self, session: int, message: str) -> None:
        super().__init__(message)
        self.session = session


# What Pipeline.run gives per step: the final stage's tokens, this step's own failure, or
# None (the step wanted no logits).
StepResult = Finalized | StepFailedError | None


@dataclass(frozen=True, slots=True)
class Step:
    session: int
    pos: int
    tokens: np.ndarray            # int32 token ids fed to stage 0
    n_logits: int = 1             # 0 = no output wanted; else len(drafts) + 1
    drafts: tuple[int, ...] = ()
    sampling: Sampling = GREEDY
    # grammar-constrained sampling: the allowed tokens of each logit row (n_logits rows of
    # uint32 words, mesh.final.apply_mask), or None
    mask: np.ndarray | None = None
    # the tokens generated before this step's first logit row, and the context's recent
    # tokens (a penalized request's)
    seen: Counts = NO_COUNTS
    # a prompt chunk's tokens that follow its first len(score) logit rows, whose logprobs
    # the final stage returns (echo; mesh.final.FinalSampler.finalize); n_logits counts
    # those rows too
    score: tuple[int, ...] = ()

    @property
    def plain_decode(self) -> bool:
        """One row, one token out, no drafts, no mask: the per-token step (template, fast lane)."""
        return (self.n_logits == 1 and not self.drafts and self.tokens.shape[0] == 1 and self.mask is None
                and not self.score)

    @property
    def samples(self) -> bool:
        """Whether the final stage samples tokens for this step (not only scores its rows)."""
        return self.n_logits > len(self.score)


class Pipeline(Protocol):
    n_stages: int

    async def run(self, steps: Sequence[Step]) -> list[StepResult]:
        """One result per step, in order. Raises when the whole batch failed."""
        ...

    async def copy_session(self, src: int, dst: int, n_pos: int) -> None:
        """Share ``src``'s KV at [0, n_pos) with the new session ``dst`` on every stage.
        Call it after the steps that filled those positions were run (sent)."""
        ...

    async def end_session(self, session: int) -> None: ...

    async def close(self) -> None: ...


async def _copy_on_engine(worker: EngineWorker, closed: str | None, src: int, dst: int, n_pos: int,
                          where: str) -> None:
    """Session ``src``'s first ``n_pos`` cells copied to ``dst`` on this node's engine
    (a pipeline's copy_session; ``closed``: why the pipeline closed, or None)."""
    if closed is not None:
        raise PipelineUnavailableError(closed)
    try:
        await worker.copy(src, dst, n_pos)
    except EngineError as exc:
        raise PipelineFailedError(f"{where}copying session {src:x}: {exc}") from exc


def _segments(steps: Sequence[Step]) -> list[Segment]:
    # n_logits on every stage (a stage without the head tells windows from prompt chunks
    # by it: StageEngine._width)
    return [Segment(s.session, s.pos, tokens=s.tokens, n_logits=s.n_logits) for s in steps]


class LocalPipeline:
    """The whole model on this node."""

    n_stages = 1

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.sampler = FinalSampler()
        self.closed: str | None = None   # why, once closed: later runs fail with it

    def _run_sync(self, steps: Sequence[Step]) -> list[StepResult]:
        outs = self.worker.engine.forward(_segments(steps), rewind=True)
        return [self._finalize(s, out) if s.n_logits else None for s, out in zip(steps, outs)]

    def _finalize(self, step: Step, logits: np.ndarray) -> Finalized | StepFailedError:
        res = self.sampler.finalize_isolated(step.session, logits, step.drafts, step.sampling, step.mask,
                                             step.seen, step.score)
        return StepFailedError(step.session, res.reason) if isinstance(res, SamplingFailed) else res

    async def run(self, steps: Sequence[Step]) -> list[StepResult]:
        if self.closed is not None:
            raise PipelineUnavailableError(self.closed)
        return await self.worker.step(sum(int(s.tokens.shape[0]) for s in steps), self._run_sync, steps)

    async def copy_session(self, src: int, dst: int, n_pos: int) -> None:
        await _copy_on_engine(self.worker, self.closed, src, dst, n_pos, "")

    async def end_session(self, session: int) -> None:
        self.sampler.forget(session)
        if self.closed is None:
            await self.worker.drop(session)

    async def close(self, reason: str = "pipeline closed") -> None:
        if self.closed is None:
            self.closed = reason
            await self.worker.close()


def _time_out(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(PipelineUnavailableError("the final stage did not answer in time"))


@dataclass(slots=True)
class _Waiting:
    """A batch sent, awaiting its answer: the TokenReturn, or a DataError for all of it."""

    fut: asyncio.Future
    sessions: frozenset[int]               # every session of the batch
    wants: frozenset[int]                  # ... of which those whose steps want tokens back
    failed: dict[int, str] = field(default_factory=dict)   # session -> why it failed alone


class MeshPipeline:
    """Stage 0 here; stages 1..n-1 on peers (``route``), reached through the fabric."""

    def __init__(self, worker: EngineWorker, fabric: Fabric, route: Sequence[str], *,
                 wire_dtype: str = "f32", reply_timeout: float = 60.0) -> None:
        self.worker = worker
        self.fabric = fabric
        self.route = list(route)
        self.n_stages = 1 + len(self.route)
        self.wire_dtype = np.float16 if wire_dtype == "f16" else np.float32
        self.reply_timeout = reply_timeout
        self._batch_ids = itertools.count(1)
        self._pending: dict[int, _Waiting] = {}
        # Hot path: a lone one-row decode step reuses its session's preencoded frame and
        # only patches batch id, position and the activation (wire.DecodeTemplate).
        self._templates: dict[int, wire.DecodeTemplate] = {}
        self._busy: dict[int, int] = {}       # session -> its frames awaiting a reply
        self._decode_rtt: float | None = None  # EWMA seconds of a decode step's round trip
        self.lane_steps = 0                   # telemetry: steps sent with SEG_LANE
        self.lane_resends = 0                 # ... of which resent over the stream
        self.refused = 0                      # replies ignored: not from the right stage
        # Sessions with frames on the stream that no reply has followed yet (prompt chunks
        # that want nothing back, copies): their next step takes the stream too, behind
        # them. On the lane it could overtake them (a prompt whose last chunk is one row,
        # its earlier chunks still crossing the stream) and reach a stage before its rows.
        self._on_stream: set[int] = set()
        self.closed: str | None = None   # why, once closed: later runs fail with it

    # Called by the node's message dispatcher for TokenReturn / DataError frames.
    # Tokens come only from the final stage of the route: another stage (or member) that
    # sent a TokenReturn for a waiting batch id would otherwise choose the tokens. Any
    # stage of the route may fail a batch with DataError (it could as well not forward).
    def on_data(self, peer: str, msg: wire.Message) -> bool:
        if isinstance(msg, (wire.TokenReturn, wire.DataError)) and not (
                peer == self.route[-1] or (isinstance(msg, wire.DataError) and peer in self.route)):
            self.refused += 1
            log.warning("%s from %s ignored: not from %s", type(msg).__name__, peer,
                        "the final stage" if isinstance(msg, wire.TokenReturn) else "a stage of this model")
            return True
        if isinstance(msg, wire.TokenReturn):
            waiting = self._pending.pop(msg.batch_id, None)
            if waiting is not None and not waiting.fut.done():
                waiting.fut.set_result(msg)
            return True
        if isinstance(msg, wire.DataError):
            waiting = self._pending.get(msg.batch_id)
            if waiting is None or waiting.fut.done():
                return True
            why = f"stage on {peer} failed: {msg.message}"
            if msg.session != WHOLE_BATCH and msg.session in waiting.sessions:
                if msg.session not in waiting.wants:
                    # a step of the batch that wants nothing back (a prefill chunk): its
                    # session's next step meets the same failure and reports it
                    return True
                # This session alone failed; the batch's TokenReturn brings the others,
                # unless none is left waiting for one.
                waiting.failed[msg.session] = why
                if len(waiting.failed) < len(waiting.wants):
                    return True
                waiting.fut.set_result(wire.TokenReturn(ref=0, batch_id=msg.batch_id, results=()))
            else:
                waiting.fut.set_exception(PipelineFailedError(why))
            self._pending.pop(msg.batch_id, None)
            return True
        return False

    def fail_all(self, reason: str) -> None:
        """A stage vanished: every waiting step fails now rather than at its timeout."""
        for waiting in self._pending.values():
            if not waiting.fut.done():
                waiting.fut.set_exception(PipelineUnavailableError(reason))
        self._pending.clear()

    async def run(self, steps: Sequence[Step]) -> list[StepResult]:
        if self.closed is not None:
            raise PipelineUnavailableError(self.closed)
        try:
            hidden = await self.worker.forward(_segments(steps), rewind=True)
        except EngineError as exc:
            raise PipelineFailedError(f"stage 0: {exc}") from exc
        act = np.concatenate(hidden, axis=0)
        if act.dtype != self.wire_dtype:
            act = act.astype(self.wire_dtype)
        batch_id = next(self._batch_ids)
        want = any(s.n_logits for s in steps)
        lane = want and self._lane_eligible(steps)
        msg = self._decode_frame(steps, batch_id, act, lane)
        if msg is None:
            msg = self._forward(steps, batch_id, act, lane)
        if not want:
            self._on_stream.update(s.session for s in steps)
            await self._send(msg, lane)
            return [None] * len(steps)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        waiting = self._pending[batch_id] = _Waiting(fut, frozenset(s.session for s in steps),
                                                     frozenset(s.session for s in steps if s.n_logits))
        for s in steps:
            self._busy[s.session] = self._busy.get(s.session, 0) + 1
        t0, resends = loop.time(), self.lane_resends
        try:
            # each constrained step's masks go right before the frame, on the same stream
            # (a masked step never takes the lane: _lane_eligible)
            for s in steps:
                if s.mask is not None and s.n_logits:
                    await self._send(wire.GrammarMask.pack(batch_id, s.session, s.mask, 32 * s.mask.shape[1]), False)
            await self._send(msg, lane)
            # Timers on the future itself rather than asyncio.wait_for: wait_for wakes this
            # task through an extra waiter, a loop iteration more on every decode step.
            timer = loop.call_later(self.reply_timeout, _time_out, fut)
            resend = loop.call_later(self._resend_after(), self._resend, fut, steps, batch_id, act) if lane else None
            try:
                reply: wire.TokenReturn = await fut
            finally:
                timer.cancel()
                if resend is not None:
                    resend.cancel()
        finally:
            self._pending.pop(batch_id, None)
            for s in steps:
                n = self._busy.pop(s.session, 1) - 1
                if n:
                    self._busy[s.session] = n
        # (a resent step's wait is not a round trip)
        if self.lane_resends == resends and all(s.plain_decode for s in steps):
            rtt = loop.time() - t0
            self._decode_rtt = rtt if self._decode_rtt is None else self._decode_rtt + 0.2 * (rtt - self._decode_rtt)
        self._on_stream.difference_update(s.session for s in steps)
        by_session = {r.session: r for r in reply.results}
        out: list[StepResult] = []
        for s in steps:
            r = by_session.get(s.session)
            if not s.n_logits:
                out.append(None)
            elif s.session in waiting.failed:
                out.append(StepFailedError(s.session, waiting.failed[s.session]))
            elif r is None or bool(r.tokens) != s.samples or len(r.scored) != len(s.score):
                out.append(StepFailedError(s.session, f"the final stage returned no tokens or scores for session "
                                                      f"{s.session:x}, or others than the step asked for"))
            else:
                lp = TokenLogprobs(r.logprobs, r.top_ids, r.top_logprobs) if r.logprobs else None
                scored = TokenLogprobs(r.scored, r.scored_top_ids, r.scored_top_logprobs) if r.scored else None
                out.append(Finalized(tuple(r.tokens), r.n_accepted, r.n_drafted, lp, scored))
        return out

    # ---- the fast lane ----------------------------------------------------------------
    #
    # One-row decode steps may travel the lossy fast lane (meshnode.net.lane), replies
    # included, when nothing else of their sessions is in flight: then no frame of the
    # session can be overtaken, and a lost one is simply sent again over the stream.

    def _lane_eligible(self, steps: Sequence[Step]) -> bool:
        return (self.fabric.lane_ready(self.route[0])
                and all(s.plain_decode and s.session not in self._busy and s.session not in self._on_stream
                        for s in steps))

    def _forward(self, steps: Sequence[Step], batch_id: int, act: np.ndarray, lane: bool) -> wire.Forward:
        flags = wire.SEG_LANE if lane else 0
        segs = tuple(
            wire.Segment(session=s.session, pos=s.pos, n_rows=int(s.tokens.shape[0]),
                         n_logits=s.n_logits, drafts=tuple(s.drafts),
                         flags=flags | wire.logprob_flags(s.sampling.top_logprobs)
                         | (wire.SEG_MASKED if s.mask is not None and s.n_logits else 0),
                         seen_ids=s.seen.ids, seen_counts=s.seen.counts, recent=s.seen.recent, score=s.score,
                         **segment_fields(s.sampling))
            for s in steps)
        return wire.Forward(ref=0, batch_id=batch_id, step=0, segments=segs, act=act)

    async def _send(self, msg: wire.Message, lane: bool) -> None:
        if lane:
            self.lane_steps += 1
            if self.fabric.send_lane(self.route[0], msg):
                return
        try:
            await self.fabric.send_data(self.route[0], msg, DATA_STREAM)
        except Exception as exc:
            raise PipelineUnavailableError(f"cannot reach stage 1 ({exc})") from exc

    def _resend_after(self) -> float:
        return max(LANE_RETRY_MIN_S, LANE_RETRY_RTTS * (self._decode_rtt or 0.0))

    def _resend(self, fut: asyncio.Future, steps: Sequence[Step], batch_id: int, act: np.ndarray) -> None:
        """No reply to a lane step: send it again over the stream, without SEG_LANE (so
        its reply comes back over streams too). Every stage rewinds to the step's
        position, so computing it twice gives the same result; a stage drops a copy
        that arrives after a newer step of its session (see StageHost)."""
        if fut.done():
            return
        self.lane_resends += 1
        log.info("batch %d: no reply over the fast lane in %.2f s; resending it over QUIC",
                 batch_id, self._resend_after())
        self.fabric.lane_missed(self.route[0])
        try:
            self.fabric.send_data_now(self.route[0], self._forward(steps, batch_id, act, False), DATA_STREAM)
        except Exception as exc:  # noqa: BLE001 - the waiting step fails with it
            fut.set_exception(PipelineUnavailableError(f"cannot reach stage 1 ({exc})"))

    def _decode_frame(self, steps: Sequence[Step], batch_id: int, act: np.ndarray,
                      lane: bool) -> memoryview | None:
        if len(steps) != 1 or not steps[0].plain_decode or steps[0].sampling.penalized:
            return None   # (a penalized step's counts change every step: no fixed frame)
        s = steps[0]
        t = self._templates.get(s.session)
        if t is None:
            t = self._templates[s.session] = wire.DecodeTemplate(
                s.session, act.shape[1], "f16" if act.dtype == np.float16 else "f32", n_logits=1,
                **segment_fields(s.sampling))
        flags = wire.logprob_flags(s.sampling.top_logprobs) | (wire.SEG_LANE if lane else 0)
        return t.encode(batch_id, 0, s.pos, act[0], flags=flags)

    async def copy_session(self, src: int, dst: int, n_pos: int) -> None:
        await _copy_on_engine(self.worker, self.closed, src, dst, n_pos, "stage 0: ")
        # Behind the prefill on the same stream, relayed stage to stage (StageHost), so
        # every stage copies after it computed the prefill. The next steps of ``src`` and
        # ``dst`` (one row each: lane material) must not overtake the prefill and the copy
        # on the fast lane: they wait until their session saw a reply.
        self._on_stream.update((src, dst))
        await self._send(wire.SessionCopy(ref=0, src=src, dst=dst, n_pos=n_pos), False)

    async def end_session(self, session: int) -> None:
        self._on_stream.discard(session)
        self._templates.pop(session, None)
        if self.closed is not None:
            return   # the engines were freed with their KV
        await self.worker.drop(session)
        # To stage 1 only, on the stream of the frames and copies: each stage relays it
        # (StageHost), so a stage frees the session before it sees the next request's
        # copy into the slot this frees (sent to every stage directly, the end could
        # reach the last stage after the copy relayed to it: no slot free there).
        try:
            await self._send(wire.SessionEnd(ref=0, session=session), False)
        except Exception:  # a gone peer has no KV to free
            log.debug("SessionEnd to %s failed", self.route[0], exc_info=True)

    async def close(self, reason: str = "pipeline closed") -> None:
        self.fail_all(reason)
        if self.closed is None:
            self.closed = reason
            await self.worker.close()
