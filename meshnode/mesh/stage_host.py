"""The data plane of a stage served for another node's model (stages 1..n-1).

Frames arrive in order on one stream from the upstream stage. Only that stage (the node
its Load named; the coordinator for stage 1) may send ``Forward``; ``Trim`` and
``SessionEnd`` come from it or from the coordinator. Everything stage 0 sends for a
session (frames, ``SessionCopy``, ``SessionEnd``) enters at stage 1 and is relayed stage
by stage on these streams, so each stage sees it in the order stage 0 sent it. Data from
any other member is dropped with a log: a member of the mesh must not be able to rewind
or end another coordinator's sessions. The queue in front of
the engine is bounded (frames and activation bytes); a Forward over the bound is answered
with ``DataError`` (BUSY) instead of growing memory (Trim and SessionEnd have their own,
larger bound: a full queue never loses the end of a session). Each ``Forward`` runs
through this stage's slice in one engine call (all its sessions' rows together). A
middle stage forwards the hidden states downstream; the final stage samples or verifies
and sends ``TokenReturn`` straight to the coordinator (stage 0), not hop by hop.
A failure answers ``DataError`` to the coordinator; it never takes the node down.

A failure is as wide as its cause. The engine call failing, a full queue or a stale
frame fail the whole batch (``DataError`` with session ``WHOLE_BATCH``). One session's
sampling failing on the final stage fails that session alone: a ``DataError`` naming it,
then the ``TokenReturn`` of the others. So does a segment that starts past what its
session holds here (its KV copy failed here): left out, the others computed. A session
that ended here (its request was cancelled while its step was in flight) is left out of
the computation; the other sessions of its batch are computed as if it had not been there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from meshnode import wire
from meshnode.engine import EngineError, Segment
from meshnode.engine.worker import EngineWorker
from meshnode.mesh.fabric_api import Fabric
from meshnode.mesh.final import Counts, FinalSampler, SamplingFailed, sampling_of
from meshnode.wire.messages import WHOLE_BATCH

log = logging.getLogger(__name__)

DATA_STREAM = "data"
ENDED_KEPT = 1024   # ended sessions remembered (see StageHost._ended)
# The queue in front of the engine. Stage 0 computes each frame before sending it, so a
# well-behaved upstream keeps a few frames per session in flight (prefill chunks do not
# wait for a reply); these bounds only stop an upstream that floods.
QUEUE_MAX_FRAMES = 256
QUEUE_MAX_BYTES = 256 * 1024 * 1024
# Trim and SessionEnd are a few bytes and must not be lost behind a full queue (a lost
# SessionEnd keeps a KV slot busy): they have their own, larger bound.
QUEUE_MAX_SMALL = 4096
# Masks kept for Forwards not yet computed (each comes right before its Forward; the
# bound only matters for an upstream that sends masks without frames).
MASKS_KEPT = 4 * QUEUE_MAX_FRAMES


@dataclass(frozen=True, slots=True)
class StageRoute:
    coordinator: str
    downstream: str | None       # None: this is the final stage
    wire_dtype: str = "f32"
    upstream: str = ""           # the only node whose Forward is computed ('': the coordinator)

    @property
    def source(self) -> str:
        return self.upstream or self.coordinator


class StageHost:
    def __init__(self, fabric: Fabric, worker: EngineWorker, route: StageRoute) -> None:
        self.fabric = fabric
        self.worker = worker
        self.route = route
        self.is_last = route.downstream is None
        self.sampler = FinalSampler()
        self._queue: asyncio.Queue = asyncio.Queue()   # bounded by accept(), not maxsize
        self._queued_bytes = 0
        self._queued_frames = 0                      # Forwards among the queued messages
        self.refused = 0                  # data messages dropped: wrong sender or queue full
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="stage-host")
        self._out_dtype = np.float16 if route.wire_dtype == "f16" else np.float32
        self.batches = 0
        self.skipped = 0                  # stale lookahead windows not computed
        # Sessions holding KV here (loop thread only), each with when a step or copy for
        # it last came (monotonic s): a session the coordinator keeps for prefix reuse
        # holds KV but gets nothing until a new request copies it; shutdown waits only
        # for sessions in use (busy_sessions).
        self._last_used: dict[int, float] = {}
        # Final stage: per session, the first position whose token is not verified yet
        # (the bonus of the last window goes there). A window starting past it builds
        # on rejected rows: a lookahead the coordinator will drop (meshnode.spec.lookahead).
        self._verified: dict[int, int] = {}
        # Per session, the newest batch computed here. Batch ids grow at stage 0, so a
        # frame older than that is a copy that took the other path (a lane step resent
        # over the stream, meshnode.mesh.pipeline) and arrived late: computing it would
        # rewind the session past newer rows.
        self._newest: dict[int, int] = {}
        # Sessions ended here lately. SessionEnd travels the QUIC stream, a decode step
        # may travel the fast lane: a step of a cancelled request can arrive after its
        # session's end, and must not bring the session back.
        self._ended: OrderedDict[int, None] = OrderedDict()
        # Sessions whose SessionCopy failed here, with why (until they end): their first
        # step then fails alone, saying so (_without_gaps).
        self._copy_failed: dict[int, str] = {}
        self._replies: set[asyncio.Task] = set()
        self._serving = False   # _serve is handling a message (a step may not overtake it)
        # Final stage: GrammarMask rows by (batch id, session), until their Forward comes.
        self._masks: dict[tuple[int, int], np.ndarray] = {}

    def accept(self, peer: str, msg: wire.Message) -> bool:
        """Queue a data-plane message from ``peer``; False if it is not one.

        A message from a node that may not send it is dropped (True: it was ours to
        refuse); a Forward over the queue bound is answered with DataError(BUSY)."""
        if not isinstance(msg, (wire.Forward, wire.Trim, wire.SessionEnd, wire.GrammarMask, wire.SessionCopy)):
            return False
        source = self.route.source
        if isinstance(msg, wire.SessionCopy) and peer != source:
            # ordered behind the prefill it copies only on the upstream's stream
            self.refused += 1
            log.warning("stage: SessionCopy from %s dropped: only %s feeds this stage", peer, source)
            return True
        allowed = peer == source or (not isinstance(msg, wire.Forward) and peer == self.route.coordinator)
        if not allowed:
            self.refused += 1
            log.warning("stage: %s from %s dropped: only %s feeds this stage", type(msg).__name__, peer, source)
            return True
        size = _act_bytes(msg)
        forward = isinstance(msg, wire.Forward)
        # a refused GrammarMask fails its session at the final stage (SEG_MASKED without a mask)
        if (self._queued_frames >= QUEUE_MAX_FRAMES or self._queued_bytes + size > QUEUE_MAX_BYTES
                if forward else self._queue.qsize() - self._queued_frames >= QUEUE_MAX_SMALL
                or self._queued_bytes + size > QUEUE_MAX_BYTES):
            self.refused += 1
            log.warning("stage queue full (%d frames, %d bytes): %s from %s refused",
                        self._queue.qsize(), self._queued_bytes, type(msg).__name__, peer)
            if isinstance(msg, wire.Forward):
                self._reply_soon(wire.DataError(
                    ref=0, batch_id=msg.batch_id, session=WHOLE_BATCH,
                    code=wire.ErrorCode.BUSY, message="stage queue full: not computed"))
            return True
        if forward and self._forward_now(msg):
            return True
        self._queued_bytes += size
        self._queued_frames += forward
        self._queue.put_nowait(msg)
        return True

    def _reply_soon(self, msg: wire.Message) -> None:
        # At most one pending reply per refused frame, and refusals only happen while
        # QUEUE_MAX_FRAMES frames wait; _forward_now adds tasks only while fewer than
        # that many are pending: the replies are bounded too.
        self._send_soon([(self.route.coordinator, msg, False)])

    def _send_soon(self, sends: list[tuple[str | None, wire.Message, bool]]) -> None:
        """Send ``sends`` in order from a task (for callers that cannot wait)."""
        async def send_all() -> None:
            for node, msg, lane in sends:
                await self._send(node, msg, lane)

        task = asyncio.get_running_loop().create_task(send_all())
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)

    async def close(self) -> None:
        for t in list(self._replies):
            t.cancel()
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):
            pass
        await self.worker.close()

    @property
    def sessions(self) -> set[int]:
        """Sessions holding KV here."""
        return set(self._last_used)

    def busy_sessions(self, idle_s: float, now: float | None = None) -> list[int]:
        """Sessions holding KV here that had a step or a copy in the last ``idle_s``
        seconds: those of requests in flight (kept, idle sessions are left out)."""
        now = time.monotonic() if now is None else now
        return sorted(s for s, t in self._last_used.items() if now - t < idle_s)

    async def _serve(self) -> None:
        while True:
            self._serving = False
            msg = await self._queue.get()
            self._serving = True
            self._queued_bytes -= _act_bytes(msg)
            self._queued_frames -= isinstance(msg, wire.Forward)
            try:
                match msg:
                    case wire.Forward():
                        await self._forward(msg)
                    case wire.GrammarMask():
                        await self._mask(msg)
                    case wire.SessionCopy(src=src, dst=dst, n_pos=n_pos):
                        await self._copy(msg, src, dst, n_pos)
                    case wire.Trim(session=session, pos=pos):
                        await self.worker.rollback(session, pos)
                    case wire.SessionEnd(session=session):
                        await self._end(msg, session)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a bad batch must not stop the stage
                err = self._failed(msg, exc)
                if err is not None:
                    await self._send(self.route.coordinator, err)

    @staticmethod
    def _failed(msg: wire.Message, exc: Exception) -> wire.DataError | None:
        """Log why ``msg`` failed here; for a Forward, the DataError the coordinator gets."""
        log.warning("stage failed on %s: %s", type(msg).__name__, exc, exc_info=not isinstance(exc, EngineError))
        if not isinstance(msg, wire.Forward):
            return None
        return wire.DataError(ref=0, batch_id=msg.batch_id, session=WHOLE_BATCH,
                              code=wire.ErrorCode.ENGINE_ERROR, message=str(exc))

    async def _mask(self, msg: wire.GrammarMask) -> None:
        """A constrained segment's masks: relayed downstream in order (before its Forward),
        kept by the final stage until that Forward is computed."""
        if not self.is_last:
            await self._send(self.route.downstream, msg)
            return
        if len(self._masks) >= MASKS_KEPT:
            self._masks.pop(next(iter(self._masks)))
        self._masks[(msg.batch_id, msg.session)] = msg.unpack()

    def _take_masks(self, msg: wire.Forward) -> dict[int, np.ndarray]:
        """The masks of ``msg``'s segments; masks of older batches (refused, or their
        Forward lost) are dropped."""
        got = {s.session: m for s in msg.segments
               if (m := self._masks.pop((msg.batch_id, s.session), None)) is not None}
        for key in [k for k in self._masks if k[0] < msg.batch_id]:
            del self._masks[key]
        return got

    async def _end(self, msg: wire.SessionEnd, session: int) -> None:
        """Free ``session`` here, then pass the end on. Relayed like the frames and
        copies rather than sent to every stage by the coordinator: then no stage sees a
        later request's SessionCopy before the end that freed its KV slot (the
        coordinator reuses the slot as soon as the end is sent)."""
        try:
            self._last_used.pop(session, None)
            self._verified.pop(session, None)
            self._newest.pop(session, None)
            self._ended[session] = None
            self._copy_failed.pop(session, None)
            if len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
            self.sampler.forget(session)
            await self.worker.drop(session)
        finally:
            if not self.is_last:
                await self._send(self.route.downstream, msg)

    async def _copy(self, msg: wire.SessionCopy, src: int, dst: int, n_pos: int) -> None:
        """Copy here, then pass it on (the next stage gets it behind the same prefill).
        A failed copy is logged; the copied session's first step then fails on this
        stage (its positions are missing) and its request with it."""
        try:
            if dst in self._ended or src in self._ended:
                log.debug("SessionCopy %x -> %x skipped: a session already ended", src, dst)
                if dst not in self._ended:
                    self._copy_not_done(dst, f"session {src:x} had ended here")
                return
            log.debug("SessionCopy %x -> %x of %d positions", src, dst, n_pos)
            try:
                await self.worker.copy(src, dst, n_pos)
            except EngineError as exc:
                self._copy_not_done(dst, str(exc))
                raise
            self._last_used[dst] = self._last_used[src] = time.monotonic()
        finally:
            if not self.is_last:
                await self._send(self.route.downstream, msg)

    def _copy_not_done(self, dst: int, why: str) -> None:
        """Remember why ``dst`` got no KV here: said again when its first step comes
        (_without_gaps). Bounded like the ended sessions."""
        self._copy_failed[dst] = why
        while len(self._copy_failed) > ENDED_KEPT:
            self._copy_failed.pop(next(iter(self._copy_failed)))

    def _compute(self, msg: wire.Forward, masks: dict[int, np.ndarray] | None = None):
        act = np.asarray(msg.act, dtype=np.float32)
        segs, row = [], 0
        for s in msg.segments:
            # n_logits on every stage: a stage without the head returns every row, but
            # tells a verify window (all rows' logits) from a prompt's chunk by it (_width)
            segs.append(Segment(s.session, s.pos, hidden=act[row:row + s.n_rows], n_logits=s.n_logits))
            row += s.n_rows
        outs = self.worker.engine.forward(segs, rewind=True)
        if not self.is_last:
            out = np.concatenate(outs, axis=0)
            return out if out.dtype == self._out_dtype else out.astype(self._out_dtype)
        results: list[wire.SegmentResult | wire.DataError] = []
        for s, logits in zip(msg.segments, outs):
            verified = s.pos + s.n_rows
            if s.n_logits:
                mask = (masks or {}).get(s.session)
                if s.flags & wire.SEG_MASKED and mask is None:
                    fin = SamplingFailed("the grammar mask of a constrained step did not arrive")
                else:
                    fin = self.sampler.finalize_isolated(s.session, logits, tuple(s.drafts),
                                                         sampling_of(s, wire.flags_top_logprobs(s.flags)),
                                                         mask, Counts(s.seen_ids, s.seen_counts, tuple(s.recent)),
                                                         tuple(s.score))
                if isinstance(fin, SamplingFailed):
                    # this session's failure: the others of the batch keep their tokens
                    results.append(wire.DataError(ref=0, batch_id=msg.batch_id, session=s.session,
                                                  code=wire.ErrorCode.ENGINE_ERROR, message=fin.reason))
                    self._verified.pop(s.session, None)
                    continue
                lp, sc = fin.logprobs, fin.scored
                results.append(wire.SegmentResult(
                    session=s.session, tokens=fin.tokens, n_accepted=fin.n_accepted,
                    n_drafted=fin.n_drafted, logprobs=lp.logprobs if lp else (),
                    top_ids=lp.top_ids if lp else (), top_logprobs=lp.top_logprobs if lp else (),
                    scored=sc.logprobs if sc else (), scored_top_ids=sc.top_ids if sc else (),
                    scored_top_logprobs=sc.top_logprobs if sc else ()))
                verified -= fin.n_drafted - fin.n_accepted   # rows holding rejected drafts
            self._verified[s.session] = verified
        return results

    def _stale(self, msg: wire.Forward) -> bool:
        """A lone window that starts past its session's verified positions (final stage):
        a lookahead whose guess already failed here. Every legitimate step starts at or
        before that position, so skipping it never changes an output."""
        if not self.is_last or len(msg.segments) != 1:
            return False
        seg = msg.segments[0]
        verified = self._verified.get(seg.session)
        return verified is not None and seg.pos > verified

    def _without_ended(self, msg: wire.Forward) -> wire.Forward:
        """``msg`` less the segments (and activation rows) of sessions ended here: their
        requests are gone, the batch's other sessions are not."""
        keep = [s for s in msg.segments if s.session not in self._ended]
        if len(keep) == len(msg.segments) or not keep:
            return msg   # (all ended: refused whole, _refusal)
        log.debug("batch %d: %d ended session(s) left out", msg.batch_id, len(msg.segments) - len(keep))
        return _keep_segments(msg, keep)

    def _gaps(self, msg: wire.Forward) -> list[wire.Segment]:
        held = self.worker.engine.next_pos
        return [s for s in msg.segments if s.pos > held(s.session)]

    def _without_gaps(self, msg: wire.Forward) -> tuple[wire.Forward | None, list[wire.DataError]]:
        """``msg`` less the segments that start past what their session holds here, and
        a DataError failing each of those sessions alone. A coordinator never sends such
        a step; if one comes (a copy that failed here, a bug), the engine would refuse the
        whole call, so the batch's other sessions are computed without it."""
        gaps = self._gaps(msg)
        if not gaps:
            return msg, []
        held = self.worker.engine.next_pos
        errors = []
        for s in gaps:
            why = f"session {s.session:x}: position {s.pos} given, this stage holds {held(s.session)}"
            if (failed := self._copy_failed.get(s.session)) is not None:
                why += f" (its KV copy failed here: {failed})"
            log.warning("batch %d: %s", msg.batch_id, why)
            errors.append(wire.DataError(ref=0, batch_id=msg.batch_id, session=s.session,
                                         code=wire.ErrorCode.NO_SUCH_SESSION, message=why))
        keep = [s for s in msg.segments if all(s is not g for g in gaps)]
        return (_keep_segments(msg, keep) if keep else None), errors

    def _refusal(self, msg: wire.Forward) -> tuple[wire.ErrorCode, str] | None:
        """Why ``msg`` must not be computed here (None: compute it)."""
        if msg.segments and all(s.session in self._ended for s in msg.segments):
            return wire.ErrorCode.NO_SUCH_SESSION, "session ended"
        if any(self._newest.get(s.session, 0) > msg.batch_id for s in msg.segments):
            return wire.ErrorCode.BAD_FIELD, "superseded (a newer batch of the session was computed)"
        if self._stale(msg):
            return wire.ErrorCode.BAD_FIELD, "stale lookahead window (starts past the verified positions)"
        return None

    async def _forward(self, msg: wire.Forward) -> None:
        msg = self._without_ended(msg)
        refused = self._refusal(msg)
        if refused is not None:
            # Answer at once, so the coordinator's step ends (it drops the result anyway)
            # and the real next step does not wait behind a useless computation.
            code, why = refused
            self.skipped += 1
            log.debug("batch %d (session %d): %s: not computed", msg.batch_id, msg.segments[0].session, why)
            await self._send(self.route.coordinator, wire.DataError(
                ref=0, batch_id=msg.batch_id, session=WHOLE_BATCH, code=code,
                message=f"{why}: not computed"))
            return
        masks = self._take_masks(msg) if self.is_last else None
        msg, gaps = self._without_gaps(msg)
        for err in gaps:
            await self._send(self.route.coordinator, err)
        if msg is None:
            return
        out = await self.worker.step(len(msg.act), self._compute, msg, masks)
        for node, reply, lane in self._computed(msg, out):
            await self._send(node, reply, lane)

    def _forward_now(self, msg: wire.Forward) -> bool:
        """Compute a fast-lane step right away, in its datagram's callback, when nothing
        is queued or being served here and the worker runs it inline: on a split's every
        token that saves the queue's wake-up. False: not such a step (queue it)."""
        # (replies waiting for the stream are tasks: past the queue's bound, the queue)
        if (self._serving or not self._queue.empty() or not msg.segments
                or len(self._replies) >= QUEUE_MAX_FRAMES
                or not all(s.flags & wire.SEG_LANE and not s.flags & wire.SEG_MASKED for s in msg.segments)
                or not self.worker.runs_inline(len(msg.act))):
            return False
        msg = self._without_ended(msg)
        if self._refusal(msg) is not None or self._gaps(msg):
            return False   # the queue's path answers it
        try:
            out = self.worker.run_inline(len(msg.act), self._compute, msg, None)
            sends = self._computed(msg, out)
            while sends and sends[0][2] and self.fabric.send_lane(sends[0][0], sends[0][1]):
                sends.pop(0)
        except Exception as exc:  # noqa: BLE001 - as in _serve: a bad batch must not stop the stage
            err = self._failed(msg, exc)
            assert err is not None
            self._reply_soon(err)
            return True
        if sends:   # (what must take the stream, in order)
            self._send_soon(sends)
        return True

    def _computed(self, msg: wire.Forward, out) -> list[tuple[str | None, wire.Message, bool]]:
        """``msg`` was computed into ``out``: note it, and return what goes out, in order
        (node, message, whether it may take the fast lane)."""
        self.batches += 1
        now = time.monotonic()
        for s in msg.segments:
            self._newest[s.session] = msg.batch_id
            self._last_used[s.session] = now
        # stage 0 marks the frames that may take the fast lane, with their reply
        lane = all(s.flags & wire.SEG_LANE for s in msg.segments)
        if not self.is_last:
            return [(self.route.downstream, wire.Forward(
                ref=0, batch_id=msg.batch_id, step=msg.step, segments=msg.segments, act=out), lane)]
        # One session's failure first, then the others' tokens, both on the data stream
        # (in order; the lane carries no DataError): stage 0 then knows the failed
        # sessions when the TokenReturn ends the batch.
        failed = [r for r in out if isinstance(r, wire.DataError)]
        results = tuple(r for r in out if isinstance(r, wire.SegmentResult))
        sends: list[tuple[str | None, wire.Message, bool]] = [(self.route.coordinator, err, False) for err in failed]
        if results:
            sends.append((self.route.coordinator, wire.TokenReturn(ref=0, batch_id=msg.batch_id, results=results),
                          lane and not failed))
        return sends

    async def _send(self, node: str | None, msg: wire.Message, lane: bool = False) -> None:
        if node is None or (lane and self.fabric.send_lane(node, msg)):
            return
        try:
            await self.fabric.send_data(node, msg, DATA_STREAM)
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot send %s to %s: %s", type(msg).__name__, node, exc)
            if isinstance(msg, wire.Forward) and node != self.route.coordinator:
                # the batch would wait out its reply timeout at stage 0: fail it now, saying why
                await self._send(self.route.coordinator, wire.DataError(
                    ref=0, batch_id=msg.batch_id, session=WHOLE_BATCH, code=wire.ErrorCode.BUSY,
                    message=f"cannot reach the next stage's node {node}: {exc}"))


def _keep_segments(msg: wire.Forward, keep: list[wire.Segment]) -> wire.Forward:
    """``msg`` with only the segments ``keep`` (in order) and their activation rows."""
    rows, row, kept = [], 0, {id(s) for s in keep}
    for s in msg.segments:
        if id(s) in kept:
            rows.append(np.arange(row, row + s.n_rows))
        row += s.n_rows
    act = np.asarray(msg.act)[np.concatenate(rows)]
    return wire.Forward(ref=msg.ref, batch_id=msg.batch_id, step=msg.step, segments=tuple(keep), act=act)


def _act_bytes(msg: wire.Message) -> int:
    if isinstance(msg, wire.GrammarMask):
        return sum(len(r.data) for r in msg.rows)
    act = getattr(msg, "act", None)
    return int(getattr(act, "nbytes", 0) or 0)
