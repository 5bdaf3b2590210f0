"""AdaptiveWindow grow/shrink/cost cap, FixedWindow, WindowPolicy validation."""

from __future__ import annotations

import pytest

from meshnode.spec.cost_model import CostModel
from meshnode.spec.window import AdaptiveWindow, FixedWindow, WindowPolicy, make_window


def test_adaptive_grows_and_shrinks():
    w = AdaptiveWindow(4, 1, 16)
    assert w.next_window() == 4
    w.update(4, 4)
    assert w.size == 6
    w.update(6, 6)
    w.update(9, 9)
    w.update(13, 13)
    assert w.size == 16  # capped at max
    w.update(16, 10)  # late rejection: keep
    assert w.size == 16
    w.update(16, 2)  # early rejection: halve
    assert w.size == 8
    w.update(8, 0)
    w.update(4, 0)
    w.update(2, 0)
    w.update(1, 0)
    assert w.size == 1 and w.next_window() == 1


def test_adaptive_acceptance_estimate_moves():
    w = AdaptiveWindow(4, 1, 16, prior_acceptance=0.5)
    before = w.acceptance
    for _ in range(10):
        w.update(4, 4)
    assert w.acceptance > 0.9 > before
    for _ in range(60):
        w.update(4, 0)
    assert w.acceptance < 0.1


def test_cost_cap_limits_window():
    cost = CostModel(step_s=0.01, row_slope=1.0)  # every row costs a full step
    w = AdaptiveWindow(16, 1, 16, cost=cost, prior_acceptance=0.5)
    assert w.size == 16
    assert w.cap < 16 and w.next_window() == w.cap
    # cheap rows (big hop latency): no cap below max
    cheap = CostModel(step_s=0.001, hop_s=0.05, row_slope=0.2)
    w2 = AdaptiveWindow(16, 1, 16, cost=cheap, prior_acceptance=0.9)
    assert w2.next_window() == 16


def test_fixed_window_and_factory():
    f = FixedWindow(6)
    f.update(6, 1)
    assert f.next_window() == 6 and 0 < f.acceptance < 1
    assert isinstance(make_window(WindowPolicy("fixed", 5, 5, 5)), FixedWindow)
    a = make_window(WindowPolicy(), CostModel())
    assert isinstance(a, AdaptiveWindow) and a.cost is not None


@pytest.mark.parametrize(
    "args", [("sliding", 4, 1, 8), ("adaptive", 40, 1, 64), ("adaptive", 2, 3, 8), ("adaptive", 4, 0, 8)]
)
def test_window_policy_validation(args):
    with pytest.raises(ValueError):
        WindowPolicy(*args)


# ---- exact windows per backend -------------------------------------------------------

def test_a_gpu_stage_caps_the_routes_windows_at_four_rows(monkeypatch):
    from meshnode.spec.window import cap_for_backends

    monkeypatch.delenv("MESHNODE_GPU_PAD_ROWS", raising=False)

    wide = WindowPolicy("adaptive", 8, 2, 16)
    # one CUDA stage anywhere on the route: 3 drafts (a window of 4 rows) at most
    for route in (["cuda"], ["cpu", "cuda"], ["cuda", "cpu", "cpu"]):
        assert cap_for_backends(wide, route) == WindowPolicy("adaptive", 3, 2, 3)
    # a GPU backend nobody measured gets the same bound; CPU and not-yet-known stages none
    assert cap_for_backends(wide, ["cpu", "metal"]).max == 3
    assert cap_for_backends(wide, ["cpu", "cpu"]) == wide
    assert cap_for_backends(wide, ["", "cpu"]) == wide
    assert cap_for_backends(wide, []) == wide


def test_the_gpu_pad_width_sets_the_cap(monkeypatch, caplog):
    """Steps padded to 5-8 rows make windows of 8 rows exact (7 drafts); 2-4 rows, 4; a
    value out of 2..8 is refused with a warning (the default, 2)."""
    from meshnode import limits
    from meshnode.limits import gpu_pad_rows

    monkeypatch.setattr(limits, "_warned_pad", set())
    from meshnode.spec.window import cap_for_backends

    wide = WindowPolicy("adaptive", 8, 2, 16)
    for value, pad, drafts in (("8", 8, 7), ("5", 5, 7), ("4", 4, 3), ("2", 2, 3), ("1", 2, 3), ("9", 2, 3),
                               ("x", 2, 3), ("", 2, 3)):
        monkeypatch.setenv("MESHNODE_GPU_PAD_ROWS", value)
        assert gpu_pad_rows() == pad
        assert cap_for_backends(wide, ["cpu", "cuda"]).max == drafts
        assert cap_for_backends(wide, ["cpu"]) == wide
    warned = [r.getMessage() for r in caplog.records if "MESHNODE_GPU_PAD_ROWS" in r.getMessage()]
    assert any("'9' is not a number in 2..8" in m for m in warned) and any("'x'" in m for m in warned)
    assert not any("'8'" in m or "''" in m for m in warned)


def test_the_cap_keeps_narrower_settings_and_stays_a_valid_policy():
    from meshnode.spec.window import cap_for_backends

    narrow = WindowPolicy("adaptive", 2, 1, 3)
    assert cap_for_backends(narrow, ["cuda"]) is narrow
    fixed = WindowPolicy("fixed", 8, 8, 8)
    assert cap_for_backends(fixed, ["cuda"]) == WindowPolicy("fixed", 3, 3, 3)
    make_window(cap_for_backends(WindowPolicy("adaptive", 16, 16, 32), ["cuda"]))   # validates


def test_the_windows_follow_the_current_route(monkeypatch):
    """A re-plan that moves the route onto a GPU stage narrows the windows chosen at start;
    one that moves it off widens them back to the configured ones."""
    from meshnode.spec.strategy import CliSpecOptions, RouteWindows, resolve_strategy

    monkeypatch.delenv("MESHNODE_GPU_PAD_ROWS", raising=False)
    spec = resolve_strategy("m", cli=CliSpecOptions(strategy="ngram"))
    route = RouteWindows(spec)
    assert not route.follow(["cpu", "cpu"]) and route.config is spec    # start: a CPU route
    assert route.follow(["cpu", "cuda"])                                # re-planned onto a GPU stage
    assert route.config.window.max == 3
    win = make_window(route.config.window)
    for _ in range(8):                       # full acceptance cannot grow it past the cap
        win.update(win.next_window(), win.next_window())
        assert win.next_window() <= 3
    assert not route.follow(["cuda"])        # the same bounds: nothing to redo
    assert route.follow(["cpu"])             # and back onto CPUs
    assert route.config.window == spec.window


def test_speculation_off_stays_off_on_any_route():
    from meshnode.spec.strategy import CliSpecOptions, RouteWindows, resolve_strategy

    off = resolve_strategy("m", cli=CliSpecOptions(mode="off"))
    for spec in (off, None):
        route = RouteWindows(spec)
        assert not route.follow(["cuda"]) and route.config is spec


def test_the_strategy_is_capped_when_a_stage_of_the_route_runs_on_cuda():
    from meshnode.spec.strategy import CliSpecOptions, exact_for_route, resolve_strategy

    spec = resolve_strategy("m", cli=CliSpecOptions(strategy="ngram"))
    assert spec.enabled and spec.window.max > 3
    assert exact_for_route(spec, ["cpu", "cuda"]).window.max == 3
    assert exact_for_route(spec, ["cpu", "cpu"]) is spec
    off = resolve_strategy("m", cli=CliSpecOptions(mode="off"))
    assert exact_for_route(off, ["cuda"]) is off
    assert exact_for_route(None, ["cuda"]) is None
