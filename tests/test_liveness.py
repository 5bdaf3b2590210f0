"""Liveness (meshnode.net.liveness): the auth deadline, the heartbeat and the dead-peer
watch, on a fake clock with no socket."""

from __future__ import annotations

import pytest

from meshnode.net.link import LinkSettings
from meshnode.net.liveness import AuthTimedOut, Liveness, PeerSilent, PeerUnreachable, SendHeartbeat


def _liveness(now: float = 100.0, **kw) -> Liveness:
    s = LinkSettings(**kw)
    return Liveness(heartbeat_s=s.heartbeat_s, dead_after_s=s.dead_after_s,
                    auth_timeout_s=s.auth_timeout_s, now=now, unreachable_s=s.unreachable_s)


def _run(lv: Liveness, until: float, *, rx_every: float | None = None, start: float = 100.0) -> list:
    """Drive ``lv`` like the link does: wake at each timer it asks for; bytes arrive every
    ``rx_every`` s. Returns (time, action) pairs."""
    out = []
    next_rx = start + rx_every if rx_every else None
    while (at := lv.next_timer()) is not None and at <= until:
        while next_rx is not None and next_rx <= at:
            lv.received(next_rx)
            next_rx += rx_every
        out += [(round(at, 6), a) for a in lv.handle_timer(at)]
    return out


def test_before_authentication_only_the_deadline_is_armed():
    lv = _liveness()
    assert lv.next_timer() == pytest.approx(103.0)           # auth_timeout_s = 3.0
    assert lv.handle_timer(102.9) == []                      # early: nothing
    assert lv.handle_timer(103.0) == [AuthTimedOut()]
    assert lv.next_timer() is None and lv.handle_timer(200.0) == []


def test_authentication_cancels_the_deadline_and_starts_heartbeats_at_once():
    lv = _liveness()
    assert not lv.heartbeating
    lv.authenticated(101.0)
    assert lv.heartbeating
    assert lv.next_timer() == 101.0
    assert lv.handle_timer(101.0) == [SendHeartbeat(1)]
    assert lv.next_timer() == pytest.approx(101.3)           # heartbeat_s = 0.3
    lv.received(103.4)
    assert lv.handle_timer(103.5) == [SendHeartbeat(2)]      # past the old deadline: no timeout


def test_heartbeats_are_due_every_period_after_the_last_one_ran():
    lv = _liveness()
    lv.authenticated(100.0)
    got = _run(lv, 101.0, rx_every=0.1)
    assert [t for t, _ in got] == pytest.approx([100.0, 100.3, 100.6, 100.9])
    assert [a for _, a in got] == [SendHeartbeat(i) for i in range(1, 5)]
    # a late wake-up (a busy loop) moves the schedule; no burst of catch-up heartbeats
    assert lv.handle_timer(101.5) == [SendHeartbeat(5)]
    assert lv.next_timer() == pytest.approx(101.8)


def test_a_silent_peer_is_dead_exactly_dead_after_s_after_its_last_byte():
    lv = _liveness()
    lv.authenticated(100.0)
    lv.received(100.1)
    got = _run(lv, 110.0)                                    # nothing arrives after 100.1
    assert [a for _, a in got[:-1]] == [SendHeartbeat(i) for i in range(1, 7)]   # 100.0 .. 101.5
    t, last = got[-1]
    assert isinstance(last, PeerSilent)
    # at the deadline itself (dead_after_s = 1.5), not at the next heartbeat (101.8)
    assert t == pytest.approx(101.6) and last.silent_s == pytest.approx(1.5)
    assert lv.next_timer() is None                           # dead: no more timers


def test_no_false_death_while_frames_keep_arriving():
    lv = _liveness()
    lv.authenticated(100.0)
    got = _run(lv, 160.0, rx_every=1.0)                      # one sign of life a second
    assert got and not any(isinstance(a, PeerSilent) for _, a in got)
    assert len(got) == 200                                   # a heartbeat every 0.3 s for 60 s


def test_a_sign_of_life_moves_the_deadline_without_a_new_timer():
    lv = _liveness(dead_after_s=1.0, heartbeat_s=0.5)
    lv.authenticated(100.0)
    assert lv.handle_timer(100.0) == [SendHeartbeat(1)]
    assert lv.handle_timer(100.5) == [SendHeartbeat(2)]
    assert lv.next_timer() == pytest.approx(101.0)           # the deadline and the heartbeat agree
    lv.received(100.9)
    assert lv.handle_timer(101.0) == [SendHeartbeat(3)]      # 0.1 s silent
    assert lv.next_timer() == pytest.approx(101.5)
    assert lv.handle_timer(101.5) == [SendHeartbeat(4)]
    assert lv.next_timer() == pytest.approx(101.9)           # the deadline comes before the heartbeat
    assert lv.handle_timer(101.8) == []                      # early: nothing
    assert lv.handle_timer(101.9) == [PeerSilent(pytest.approx(1.0))]


def test_a_late_wake_up_blames_our_own_stall_not_the_peer():
    """This loop was stalled 3 s: the peer's datagrams of that time are still unread. The
    verdict waits one heartbeat period, in which the loop reads them."""
    lv = _liveness()
    lv.authenticated(100.0)
    assert lv.handle_timer(100.0) == [SendHeartbeat(1)]
    assert lv.handle_timer(103.0) == [SendHeartbeat(2)]      # 3 s silent, but we woke 2.7 s late
    assert lv.next_timer() == pytest.approx(103.3)
    lv.received(103.01)                                      # what the peer sent during the stall
    got = _run(lv, 110.0, rx_every=0.2, start=103.01)
    assert got and not any(isinstance(a, PeerSilent) for _, a in got)


def test_after_a_late_wake_up_a_dead_peer_is_dropped_one_period_later():
    lv = _liveness()
    lv.authenticated(100.0)
    assert lv.handle_timer(100.0) == [SendHeartbeat(1)]
    assert lv.handle_timer(103.0) == [SendHeartbeat(2)]
    assert lv.handle_timer(103.3) == [PeerSilent(pytest.approx(3.3))]


def test_a_slightly_late_wake_up_still_judges_at_once():
    lv = _liveness()
    lv.authenticated(100.0)
    lv.received(100.1)
    _run(lv, 101.5)
    assert lv.next_timer() == pytest.approx(101.6)
    assert lv.handle_timer(101.8) == [PeerSilent(pytest.approx(1.7))]   # 0.2 s late: a busy loop, not a stall


def test_the_longest_silence_of_a_live_link_is_recorded():
    lv = _liveness()
    lv.authenticated(100.0)
    _run(lv, 103.0, rx_every=0.25)
    assert 0.0 < lv.max_silent_s <= 0.25 + 1e-9
    lv.received(103.0)
    _run(lv, 104.2, start=103.0)                             # 1.2 s without a byte
    lv.received(104.2)
    assert lv.max_silent_s == pytest.approx(1.2, abs=0.31)   # seen at the heartbeat ticks
    assert lv.heartbeating and lv.next_timer() is not None   # still alive


def test_configured_settings_are_used():
    lv = _liveness(heartbeat_s=1.0, dead_after_s=5.0, auth_timeout_s=10.0)
    assert lv.next_timer() == pytest.approx(110.0)
    lv.authenticated(100.0)
    got = _run(lv, 120.0)
    assert [t for t, _ in got] == pytest.approx([100.0 + i for i in range(6)])
    assert isinstance(got[-1][1], PeerSilent)                # at 105: 5 s without a byte


def test_stop_ends_every_timer():
    lv = _liveness()
    lv.authenticated(100.0)
    lv.stop()
    assert lv.next_timer() is None and lv.handle_timer(200.0) == []


# ---- the unreachable hint (ICMP, meshnode.net.icmp) ----------------------------------

def test_an_unreachable_hint_sends_a_heartbeat_and_drops_a_silent_peer_after_unreachable_s():
    lv = _liveness()
    lv.authenticated(100.0)
    assert lv.handle_timer(100.0) == [SendHeartbeat(1)]
    lv.received(100.1)
    assert lv.unreachable(100.2) == [SendHeartbeat(2)]       # probe the peer now
    assert lv.unreachable(100.25) == []                      # one probe per hint
    assert lv.next_timer() == pytest.approx(100.3)           # the next heartbeat comes first
    out = _run(lv, 101.0)
    # dropped 0.5 s after the hint (not 1.5 s after the last byte)
    assert out == [(100.3, SendHeartbeat(3)), (100.6, SendHeartbeat(4)), (100.7, PeerUnreachable(pytest.approx(0.5)))]
    assert lv.next_timer() is None


def test_a_byte_after_the_hint_clears_it():
    lv = _liveness()
    lv.authenticated(100.0)
    lv.handle_timer(100.0)
    assert lv.unreachable(100.1) == [SendHeartbeat(2)]
    lv.received(100.15)                                      # the peer answered: alive
    out = _run(lv, 102.0, rx_every=0.3)
    assert not any(isinstance(a, (PeerUnreachable, PeerSilent)) for _, a in out)
    assert lv.unreachable(102.0) == [SendHeartbeat(lv.seq)]  # a new hint probes again


def test_an_unreachable_hint_before_authentication_closes_without_a_heartbeat():
    lv = _liveness()
    assert lv.unreachable(100.5) == []                       # no heartbeat before authentication
    assert lv.next_timer() == pytest.approx(101.0)           # before the 3 s deadline
    assert lv.handle_timer(101.0) == [PeerUnreachable(pytest.approx(0.5))]


def test_hints_are_ignored_when_off_and_after_stop():
    lv = Liveness(heartbeat_s=0.3, dead_after_s=1.5, auth_timeout_s=3.0, now=100.0)
    lv.authenticated(100.0)
    assert lv.unreachable(100.1) == [] and lv.hinted_at is None
    lv2 = _liveness()
    lv2.stop()
    assert lv2.unreachable(100.1) == [] and lv2.next_timer() is None


def test_a_stalled_loop_waits_before_judging_a_hint():
    lv = _liveness()
    lv.authenticated(100.0)
    lv.handle_timer(100.0)
    lv.received(100.0)
    lv.unreachable(100.1)
    # this loop slept through the deadline (100.6) by far: the peer's answer may be unread
    assert lv.handle_timer(101.0) == [SendHeartbeat(3)]       # no verdict yet
    assert lv.next_timer() == pytest.approx(101.3)
    lv.received(101.05)                                      # it was there
    assert not any(isinstance(a, (PeerUnreachable, PeerSilent)) for a in lv.handle_timer(101.3))
