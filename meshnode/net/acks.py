"""When a link acknowledges what it received: in the next packet it sends, if that
comes first; on its own otherwise.

aioquic acknowledges an ack-eliciting packet ``K_GRANULARITY`` (1 ms) after it
arrives, and only puts the ACK frame into an outgoing packet once that millisecond has
passed: a reply sent within the millisecond leaves without the ACK, and a separate ACK
datagram follows. A split decode step is a request and a reply on a link: stage 0 sends
an activation, the final stage answers with a token. On the 2-core VM of DESIGN.md the
extra datagrams showed up as ~0.7 standalone ACKs per token (UDP counters), each a
``sendto`` that wakes the other process.

The policy here (TCP's delayed ACK, shaped for our traffic):

* the ACK's deadline stays aioquic's (1 ms after the first unacknowledged packet);
* anything the link sends before then carries it (:meth:`DelayedAcks.before_send`);
* after two *full-sized* datagrams (>= ``FULL_DATAGRAM`` bytes, what a bulk flow sends)
  it goes out at once, as RFC 9000 section 13.2.2 recommends, so a sender whose
  congestion window holds two datagrams (in recovery) never waits for the timer. An
  activation that spans one full datagram and a short one is not a bulk flow: its ACK
  rides on the reply.

It touches aioquic's private packet-number space; :meth:`DelayedAcks.attach` returns
``None`` when that is not there (another aioquic version), and the link keeps aioquic's
own behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aioquic import tls

FULL_DATAGRAM = 1200     # QUIC's smallest maximum datagram size
ACK_EVERY = 2            # full-sized datagrams


class DelayedAcks:
    def __init__(self, space: Any, *, every: int = ACK_EVERY) -> None:
        self._space = space
        self.every = every
        self._full = 0    # full-sized datagrams received since the last ACK left

    @classmethod
    def attach(cls, quic: Any, **kwargs: Any) -> "DelayedAcks | None":
        """The policy for ``quic``'s 1-RTT space (call once the handshake completed)."""
        space = getattr(quic, "_spaces", {}).get(tls.Epoch.ONE_RTT)
        if space is None or not hasattr(space, "ack_at"):
            return None
        return cls(space, **kwargs)

    def receive(self, receive: Callable[[], None], size: int, now: float) -> None:
        """Run ``receive()`` (aioquic's ``receive_datagram`` of ``size`` bytes) and
        bring the ACK it asked for forward if a bulk flow needs it now."""
        space = self._space
        if space.ack_at is None:     # the last ACK left
            self._full = 0
        receive()
        if space.ack_at is None or size < FULL_DATAGRAM:
            return
        self._full += 1
        if self._full >= self.every:
            space.ack_at = now

    def due(self, now: float) -> bool:
        """An ACK must leave now."""
        return self._space.ack_at is not None and self._space.ack_at <= now

    def before_send(self, now: float) -> None:
        """Call before queueing data: the packet it goes out in carries the pending ACK."""
        space = self._space
        if space.ack_at is not None and space.ack_at > now:
            space.ack_at = now
