"""DelayedAcks (pure logic over a stand-in for aioquic's packet-number space)."""

from __future__ import annotations

from dataclasses import dataclass

from meshnode.net.acks import FULL_DATAGRAM, DelayedAcks


@dataclass
class _Space:
    ack_at: float | None = None


def _receive(acks: DelayedAcks, space: _Space, size: int, now: float, eliciting: bool = True) -> None:
    def aioquic_receive() -> None:   # aioquic: the first unacknowledged packet sets the timer
        if eliciting and space.ack_at is None:
            space.ack_at = now + 0.001
    acks.receive(aioquic_receive, size, now)


def test_reply_before_the_timer_carries_the_ack():
    space = _Space()
    acks = DelayedAcks(space)
    _receive(acks, space, 2400, now=10.0)          # one (full-sized) activation datagram
    assert space.ack_at == 10.001 and not acks.due(10.0)
    acks.before_send(10.0004)                        # the reply leaves 0.4 ms later
    assert space.ack_at == 10.0004 and acks.due(10.0004)


def test_two_full_datagrams_are_acknowledged_at_once():
    space = _Space()
    acks = DelayedAcks(space)
    _receive(acks, space, FULL_DATAGRAM, now=1.0)
    assert not acks.due(1.0)
    _receive(acks, space, 16384, now=1.0002)
    assert acks.due(1.0002) and space.ack_at == 1.0002


def test_a_full_and_a_short_datagram_wait_for_the_reply():
    # a LAN-sized f32 activation of SmolLM2: 1350 + ~1000 bytes, not a bulk flow
    space = _Space()
    acks = DelayedAcks(space)
    _receive(acks, space, 1350, now=1.0)
    _receive(acks, space, 1000, now=1.0001)
    assert not acks.due(1.0001) and space.ack_at == 1.001


def test_the_count_restarts_once_an_ack_left():
    space = _Space()
    acks = DelayedAcks(space)
    _receive(acks, space, 1350, now=1.0)
    space.ack_at = None                              # the ACK went out (timer or piggyback)
    _receive(acks, space, 1350, now=2.0)
    assert not acks.due(2.0)                         # one full datagram since, not two


def test_nothing_pending_nothing_due():
    space = _Space()
    acks = DelayedAcks(space)
    _receive(acks, space, 1350, now=1.0, eliciting=False)   # a pure ACK from the peer
    assert space.ack_at is None and not acks.due(1.0)
    acks.before_send(1.0)
    assert space.ack_at is None


def test_attach_needs_aioquic_spaces():
    assert DelayedAcks.attach(object()) is None
