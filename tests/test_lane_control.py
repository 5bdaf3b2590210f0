"""LaneControl (meshnode.net.lane_control): the fast lane's probing, readiness, misses,
switch-off and backoff, on a fake clock with no socket."""

from __future__ import annotations

from meshnode.net.lane_control import LANE_LOSS_WINDOW, LANE_MAX_BACKOFF_S, LANE_MAX_PROBES, LaneControl

HB = 0.3   # the heartbeat that paces the probes


def _ready(now: float = 0.0, backoff_s: float = 5.0) -> LaneControl:
    lane = LaneControl(backoff_s)
    seq = lane.key_received(now)
    assert seq is not None and lane.echo_received(seq)
    return lane


def _switch_off(lane: LaneControl, now: float) -> float:
    first, second = lane.missed(now), lane.missed(now)
    assert first is None and second is not None and not lane.ready
    return second


def test_no_probe_before_the_peer_key_and_one_at_once_when_it_arrives():
    lane = LaneControl(5.0)
    assert lane.heartbeat(0.0) is None and lane.heartbeat(0.3) is None   # nothing to seal with
    assert not lane.ready
    assert lane.key_received(0.5) == 1                                     # probe number 1, now
    assert not lane.ready                                                  # sent is not proven


def test_ready_only_after_an_echo_then_probing_stops():
    lane = LaneControl(5.0)
    lane.key_received(0.0)
    assert lane.heartbeat(HB) == 2 and not lane.ready
    assert lane.echo_received(2) is True and lane.ready
    assert lane.echo_received(1) is False             # a late echo of the other probe: no news
    assert lane.heartbeat(2 * HB) is None             # ready: heartbeats send no probes


def test_probing_gives_up_after_the_maximum_probes():
    lane = LaneControl(5.0)
    seqs = [lane.key_received(0.0)] + [lane.heartbeat(i * HB) for i in range(1, 20)]
    assert seqs[:LANE_MAX_PROBES] == list(range(1, LANE_MAX_PROBES + 1))
    assert seqs[LANE_MAX_PROBES:] == [None] * (20 - LANE_MAX_PROBES)
    assert lane.echo_received(3) and lane.ready       # a late echo still makes it ready


def test_two_misses_in_a_row_switch_it_off():
    lane = _ready()
    assert lane.missed(1.0) is None and lane.ready
    assert lane.missed(1.1) == 5.0 and not lane.ready


def test_a_second_miss_within_the_loss_window_switches_it_off():
    """A lossy path loses a frame now and then, never two in a row: each loss stalls a
    stream for a second, so one loss in fewer than LANE_LOSS_WINDOW frames is too many."""
    lane = _ready()
    assert lane.missed(1.0) is None
    for _ in range(LANE_LOSS_WINDOW - 1):
        lane.frame_received()
    assert lane.missed(2.0) == 5.0 and not lane.ready


def test_losses_rarer_than_the_window_keep_it_on():
    lane = _ready()
    for t in range(10):
        assert lane.missed(t) is None
        for _ in range(LANE_LOSS_WINDOW):
            lane.frame_received()
    assert lane.ready


def test_stays_off_through_the_backoff_then_probes_and_recovers():
    lane = _ready(backoff_s=5.0)
    assert _switch_off(lane, 10.0) == 5.0
    t = 10.0
    while t + HB < 15.0:                               # heartbeats during the backoff: no probe
        t += HB
        assert lane.heartbeat(t) is None and not lane.ready
    assert lane.heartbeat(15.0) == 2                   # a new attempt
    assert lane.probes == 1
    assert lane.echo_received(2) and lane.ready
    assert lane.missed(15.5) is None and lane.ready   # a fresh attempt: losses before it do not count


def test_the_backoff_doubles_with_every_switch_off_up_to_a_limit():
    lane = _ready(backoff_s=5.0)
    waits = []
    now = 0.0
    for _ in range(9):
        wait = _switch_off(lane, now)
        waits.append(wait)
        now += wait
        assert lane.heartbeat(now - 0.01) is None      # still backing off
        seq = lane.heartbeat(now)
        assert seq is not None and lane.probes == 1
        assert lane.echo_received(seq)
    assert waits == [5.0, 10.0, 20.0, 40.0, 80.0, 160.0, LANE_MAX_BACKOFF_S, LANE_MAX_BACKOFF_S,
                     LANE_MAX_BACKOFF_S]


def test_a_clean_window_brings_the_backoff_back_to_its_start():
    lane = _ready(backoff_s=5.0)
    assert _switch_off(lane, 0.0) == 5.0
    seq = lane.heartbeat(5.0)
    assert seq is not None and lane.echo_received(seq)
    for _ in range(LANE_LOSS_WINDOW - 1):
        lane.frame_received()
    assert _switch_off(lane, 10.0) == 10.0          # not a clean window yet: doubled
    seq = lane.heartbeat(20.0)
    assert seq is not None and lane.echo_received(seq)
    for _ in range(LANE_LOSS_WINDOW):
        lane.frame_received()
    assert _switch_off(lane, 30.0) == 5.0           # a clean window: back to the start


def test_a_late_echo_from_before_the_switch_off_does_not_bring_it_back():
    lane = LaneControl(1.0)
    assert lane.key_received(0.0) == 1 and lane.heartbeat(HB) == 2   # two probes in flight
    assert lane.echo_received(1)
    _switch_off(lane, 1.0)
    assert not lane.echo_received(2) and not lane.ready       # probe 2 was sent before the switch-off
    assert not lane.echo_received(99) and not lane.ready      # never sent
    assert lane.heartbeat(2.0) == 3 and lane.echo_received(3) and lane.ready


def test_misses_while_off_do_not_switch_it_off_again():
    lane = _ready(backoff_s=1.0)
    assert _switch_off(lane, 0.0) == 1.0
    assert [lane.missed(0.5) for _ in range(5)] == [None] * 5   # frames already in flight
    assert lane.probe_at == 1.0 and lane.offs == 1


def test_a_repeated_key_probes_again_within_the_limit():
    lane = LaneControl(5.0)
    assert lane.key_received(0.0) == 1
    assert lane.key_received(0.1) == 2 and lane.probes == 2


def test_closed_means_not_ready():
    lane = _ready()
    lane.closed()
    assert not lane.ready
