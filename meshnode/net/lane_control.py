"""When a link may use the fast lane: probing, readiness, misses, switch-off and backoff.

Theory of operation: the fast lane (:mod:`meshnode.net.lane`) is lossy UDP beside QUIC,
and a path may drop it (a firewall, IP fragments, a path that changed) while QUIC gets
through. So a link trusts the lane only after seeing it work, and stops trusting it when
it stops working:

* *probing*: once the peer's lane key arrived, the link sends a probe (a Heartbeat
  padded to the largest lane frame) at once and then one per heartbeat, at most
  ``LANE_MAX_PROBES`` per attempt;
* *ready*: the first probe of the current attempt that comes back (its echo, over the
  lane) makes the lane ready; per-token frames then take it. Probes are numbered across
  attempts, so a late echo of a probe sent before a switch-off proves nothing about the
  path now and is ignored;
* *misses*: the lane's user reports every frame that got no answer in time
  (:meth:`LaneControl.missed`), and every frame that arrives over the lane is counted. A
  second miss with fewer than ``LANE_LOSS_WINDOW`` frames received since the first
  switches the lane off. Each lost frame stalls its stream for the resend timeout (at
  least a second) while the lane saves well under a millisecond a token, so a path that
  loses more than about one frame in a thousand (Wi-Fi; a wide decode row travels as a
  dozen IP fragments, and losing any loses the frame) is faster over QUIC, whose own
  retransmission takes a round trip; a path that stopped carrying the lane at all is
  switched off at its second lost frame;
* *backoff*: a lane switched off is not probed for ``backoff_s``, doubled with every
  switch-off (at most ``LANE_MAX_BACKOFF_S``): a lane that keeps failing, e.g. in one
  direction only, must not keep costing resends. After the backoff it is probed again
  from scratch and recovers the same way; ``LANE_LOSS_WINDOW`` frames in a row without a
  loss bring the backoff back to ``backoff_s`` (a slow stage that once looked like a lost
  frame must not keep the lane off for minutes).

:class:`LaneControl` is sans-IO, like aioquic's ``QuicConnection``: it never sends, reads
a clock or sleeps. The link feeds it events with the current time ``now`` (any
monotonic seconds) and sends the probes it is told to. It has no timer of its own: the
link's heartbeat (:mod:`meshnode.net.liveness`) paces the probes, so a probe after a
backoff goes out with the first heartbeat past it.
"""

from __future__ import annotations

__all__ = ["LANE_LOSS_WINDOW", "LANE_MAX_BACKOFF_S", "LANE_MAX_PROBES", "LaneControl"]

LANE_MAX_PROBES = 10          # lane probes per attempt (one per heartbeat) before giving up
LANE_LOSS_WINDOW = 1000       # a second lost frame within this many frames of the first switches it off
LANE_MAX_BACKOFF_S = 300.0    # the doubling backoff stops growing here


class LaneControl:
    """The fast lane's state for one link; see the module docstring.

    ``ready`` says whether frames may take the lane now. Probe sequence numbers count
    from 1 over the link's life; an echo counts only for a probe of the current attempt.
    """

    __slots__ = ("backoff_s", "ready", "keyed", "seq", "first", "lost", "clean", "offs", "probe_at")

    def __init__(self, backoff_s: float) -> None:
        self.backoff_s = backoff_s
        self.ready = False        # a probe came back over the lane, and no switch-off since
        self.keyed = False        # the peer's lane key arrived: we can seal for it
        self.seq = 0              # the last probe's number (all attempts)
        self.first = 1            # the number of this attempt's first probe
        self.lost = False         # a frame was lost since the lane became ready
        self.clean = 0            # frames received since then, or since the last loss
        self.offs = 0             # switch-offs since the lane last carried a clean window
        self.probe_at = 0.0       # no probe before this time (the backoff)

    # ---- events --------------------------------------------------------------

    def key_received(self, now: float) -> int | None:
        """The peer's lane key arrived. Returns the seq of a probe to send now, or None."""
        self.keyed = True
        return self._probe(now)

    def heartbeat(self, now: float) -> int | None:
        """The link sent a heartbeat: the probing clock. Returns the seq of a probe to send
        now, or None (ready, no key yet, out of probes, or still backing off)."""
        if self.ready:
            return None
        return self._probe(now)

    @property
    def probes(self) -> int:
        """Probes sent in this attempt."""
        return self.seq - self.first + 1

    def echo_received(self, seq: int) -> bool:
        """Probe ``seq`` came back over the lane. True when that made the lane ready; an
        echo of a probe from before the last switch-off (still in flight then) is no news."""
        if self.ready or not self.first <= seq <= self.seq:
            return False
        self.ready, self.lost, self.clean = True, False, 0
        return True

    def frame_received(self) -> None:
        """A frame (not a probe) arrived over the lane: the lane works."""
        self.clean += 1
        if self.clean >= LANE_LOSS_WINDOW:   # a window without loss: the path is good again
            self.lost, self.offs = False, 0

    def missed(self, now: float) -> float | None:
        """A frame sent on the lane got no answer in time. Returns the backoff (seconds
        until the next probe) when this switched the lane off, else None."""
        lossy = self.lost and self.clean < LANE_LOSS_WINDOW
        self.lost, self.clean = True, 0
        if not (self.ready and lossy):
            return None
        wait = min(LANE_MAX_BACKOFF_S, self.backoff_s * 2 ** self.offs)
        self.ready = False
        self.offs += 1
        self.first = self.seq + 1
        self.probe_at = now + wait
        return wait

    def closed(self) -> None:
        """The link closed: nothing goes on the lane any more."""
        self.ready = False

    # ---- helpers -------------------------------------------------------------

    def _probe(self, now: float) -> int | None:
        if not self.keyed or self.probes >= LANE_MAX_PROBES or now < self.probe_at:
            return None
        self.seq += 1
        return self.seq
