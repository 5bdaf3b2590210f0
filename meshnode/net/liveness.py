"""A link's clock: the authentication deadline, the heartbeat and the dead-peer watch.

Theory of operation: a QUIC link must authenticate within ``auth_timeout_s`` of being
created, or it is closed. Once authenticated it sends a Heartbeat every
``heartbeat_s`` (its echo gives the RTT, and it keeps bytes flowing both ways); every
byte that arrives from the peer, on a stream or on the fast lane, counts as a sign of
life. ``dead_after_s`` of silence and the peer counts as dead (a killed process, a
pulled cable); the link closes and the fabric drops the peer. The watch wakes at that
deadline itself (not at the next heartbeat), so death is noticed ``dead_after_s`` after
the last byte, never up to a heartbeat period later. QUIC's idle timeout is only a
backstop, set longer (docs/mesh.md, "Failure detection", derives the values).

A late wake-up means *this* event loop was stalled (a long callback, a starved CPU):
the peer's datagrams of that time are still unread in the socket, and judging the
silence now would blame the peer for our own stall. So after a wake-up more than
``heartbeat_s`` late the verdict waits one more ``heartbeat_s`` (the loop reads what
arrived first); a peer that really died is then dropped that much later.

A crashed peer on a host that stays up is noticed sooner: the host answers our next
datagram with ICMP "port unreachable" (net/icmp.py), and the link calls
:meth:`Liveness.unreachable`. Anyone on the LAN can forge such a packet, so it is only
a hint: the link sends a heartbeat at once, and the peer is dropped
(:class:`PeerUnreachable`) only if not one byte arrives from it within
``unreachable_s`` of the hint. A live peer answers within a round trip; a forged hint
costs one heartbeat.

The next heartbeat is due ``heartbeat_s`` after the previous one *ran*, not after it
was due, as a sleeping loop would do: a late tick (a busy event loop) never causes a
burst of catch-up heartbeats.

:class:`Liveness` is sans-IO in the style of aioquic's ``QuicConnection``: it is fed
events with the current time ``now`` (any monotonic seconds), says when it wants to be
woken (:meth:`Liveness.next_timer`), and when woken (:meth:`Liveness.handle_timer`)
returns what the link must do: :class:`SendHeartbeat`, :class:`PeerSilent` or
:class:`AuthTimedOut`. It never sends, sleeps or reads a clock;
:class:`meshnode.net.link.PeerLink` is its asyncio driver (one timer, re-armed after
every event).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AuthTimedOut", "Liveness", "LivenessAction", "PeerSilent", "PeerUnreachable", "SendHeartbeat"]


@dataclass(frozen=True, slots=True)
class SendHeartbeat:
    """Send Heartbeat number ``seq`` now (numbered from 1)."""
    seq: int


@dataclass(frozen=True, slots=True)
class PeerSilent:
    """Nothing arrived from the peer for ``silent_s`` (> ``dead_after_s``): it is gone."""
    silent_s: float


@dataclass(frozen=True, slots=True)
class PeerUnreachable:
    """The peer's address was reported unreachable and nothing arrived from it in the
    ``waited_s`` since (>= ``unreachable_s``): it is gone."""
    waited_s: float


@dataclass(frozen=True, slots=True)
class AuthTimedOut:
    """The link did not authenticate within ``auth_timeout_s``: close it."""


LivenessAction = SendHeartbeat | PeerSilent | PeerUnreachable | AuthTimedOut


class Liveness:
    """Timers of one link; see the module docstring. ``now`` is the creation time."""

    __slots__ = ("heartbeat_s", "dead_after_s", "unreachable_s", "auth_deadline", "last_rx",
                 "next_heartbeat", "seq", "stopped", "max_silent_s", "judge_from", "hinted_at")

    def __init__(self, *, heartbeat_s: float, dead_after_s: float, auth_timeout_s: float,
                 now: float, unreachable_s: float | None = None) -> None:
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        # after an unreachable hint, the silence that drops the peer (None: hints ignored)
        self.unreachable_s = unreachable_s
        self.hinted_at: float | None = None   # the pending unreachable hint, if any
        self.auth_deadline: float | None = now + auth_timeout_s   # None once authenticated
        self.last_rx = now                                          # the last sign of life
        self.next_heartbeat: float | None = None                    # None until authenticated
        self.seq = 0                                                # heartbeats sent
        self.stopped = False                                        # closed: no more timers
        # The longest silence a heartbeat tick saw on a live link: how close the watch came
        # to a false detection (the link logs each new record).
        self.max_silent_s = 0.0
        self.judge_from = float("-inf")   # no verdict before this (set after a late wake-up)

    @property
    def heartbeating(self) -> bool:
        """True once :meth:`authenticated` was called."""
        return self.next_heartbeat is not None

    # ---- events --------------------------------------------------------------

    def authenticated(self, now: float) -> None:
        """The handshake succeeded: the deadline is met, heartbeats start now."""
        self.auth_deadline = None
        self.last_rx = now
        self.next_heartbeat = now

    def received(self, now: float) -> None:
        """Bytes arrived from the peer (a stream or the lane): it lives, whatever any
        unreachable hint said."""
        self.last_rx = now
        self.hinted_at = None

    def unreachable(self, now: float) -> list[LivenessAction]:
        """The kernel reported the peer's address unreachable (net/icmp.py), a hint anyone
        could forge: unless a byte arrives within ``unreachable_s``, the timer reports
        :class:`PeerUnreachable`. Returns a heartbeat to send now (so that a live peer
        answers at once) for the first hint of an authenticated link; else nothing."""
        if self.stopped or self.unreachable_s is None or self.hinted_at is not None:
            return []
        self.hinted_at = now
        if self.next_heartbeat is None:
            return []   # not authenticated yet: the QUIC handshake retransmits by itself
        self.seq += 1
        return [SendHeartbeat(self.seq)]

    def stop(self) -> None:
        """The link is closing or closed: no more timers or actions."""
        self.stopped = True

    # ---- timers --------------------------------------------------------------

    def next_timer(self) -> float | None:
        """When :meth:`handle_timer` wants to be called next, or None (never): the next
        heartbeat or the dead-peer deadline, whichever comes first. Bytes that arrive
        move the deadline later without a new timer: an early call does nothing and
        asks again."""
        if self.stopped:
            return None
        hint = self._hint_deadline()
        if self.auth_deadline is not None:
            return self.auth_deadline if hint is None else min(self.auth_deadline, hint)
        if self.next_heartbeat is None:
            return hint
        due = min(self.next_heartbeat, max(self.last_rx + self.dead_after_s, self.judge_from))
        return due if hint is None else min(due, hint)

    def _hint_deadline(self) -> float | None:
        if self.hinted_at is None or self.unreachable_s is None:
            return None
        return max(self.hinted_at + self.unreachable_s, self.judge_from)

    def handle_timer(self, now: float) -> list[LivenessAction]:
        """What is due at ``now`` (nothing when called early)."""
        if self.stopped:
            return []
        due = self.next_timer()
        if due is None or now < due:
            return []
        if self.heartbeating and now - due > self.heartbeat_s:
            # this loop was stalled: read what arrived first
            self.judge_from = now + self.heartbeat_s
        hint = self._hint_deadline()
        if hint is not None and now >= hint and self.hinted_at is not None:
            self.stopped = True
            return [PeerUnreachable(now - self.hinted_at)]
        if self.auth_deadline is not None:
            if now < self.auth_deadline:
                return []
            self.stopped = True
            return [AuthTimedOut()]
        if self.next_heartbeat is None:
            return []
        silent = now - self.last_rx
        if silent >= self.dead_after_s and now >= self.judge_from:
            self.stopped = True
            return [PeerSilent(silent)]
        self.max_silent_s = max(self.max_silent_s, silent)
        if now < self.next_heartbeat:
            return []
        self.seq += 1
        self.next_heartbeat = now + self.heartbeat_s
        return [SendHeartbeat(self.seq)]
