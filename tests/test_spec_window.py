"""AdaptiveWindow grow/shrink/cost cap, FixedWindow, WindowPolicy validation."""

from __future__ import annotations

import dataclasses

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

@dataclasses.dataclass(frozen=True)
class _Stage:
    """A route's stage as speculation sees it (state.StageInfo has these two fields)."""

    backend: str
    gpu_pad_rows: int = 0


def _route(*backends: str, pad: int = 0):
    return [_Stage(b, pad) for b in backends]


def test_a_gpu_stage_caps_the_routes_windows_at_four_rows():
    from meshnode.spec.window import cap_for_route

    wide = WindowPolicy("adaptive", 8, 2, 16)
    # one CUDA stage anywhere on the route: 3 drafts (a window of 4 rows) at most
    for route in (("cuda",), ("cpu", "cuda"), ("cuda", "cpu", "cpu")):
        assert cap_for_route(wide, _route(*route)) == WindowPolicy("adaptive", 3, 2, 3)
    # a GPU backend nobody measured gets the same bound; CPU and not-yet-known stages none
    assert cap_for_route(wide, _route("cpu", "metal")).max == 3
    assert cap_for_route(wide, _route("cpu", "cpu")) == wide
    assert cap_for_route(wide, _route("", "cpu")) == wide
    assert cap_for_route(wide, []) == wide


def test_each_gpu_stage_caps_at_its_own_nodes_pad_width():
    """Steps padded to 5-8 rows make windows of 8 rows exact (7 drafts); 2-4 rows, 4; a
    node that did not say (0) pads to the default 2. The narrowest stage caps the route: a
    coordinator padding to 8 must not send 8-row windows to a stage that pads to 2."""
    from meshnode.spec.window import cap_for_route

    wide = WindowPolicy("adaptive", 8, 2, 16)
    for pad, drafts in ((8, 7), (5, 7), (4, 3), (2, 3), (0, 3)):
        assert cap_for_route(wide, _route("cpu", "cuda", pad=pad)).max == drafts
        assert cap_for_route(wide, _route("cpu", pad=pad)) == wide
    assert cap_for_route(wide, [_Stage("cuda", 8), _Stage("cuda", 2)]).max == 3
    assert cap_for_route(wide, [_Stage("cuda", 8), _Stage("cpu", 0)]).max == 7


def test_the_pad_width_comes_from_the_environment(monkeypatch, caplog):
    """MESHNODE_GPU_PAD_ROWS sets this node's width; a value out of 2..8 is refused with a
    warning (the default, 2), once per value."""
    from meshnode import limits
    from meshnode.limits import gpu_pad_rows

    monkeypatch.setattr(limits, "_warned_env", set())
    for value, pad in (("8", 8), ("5", 5), ("4", 4), ("2", 2), ("1", 2), ("9", 2), ("x", 2), ("", 2)):
        monkeypatch.setenv("MESHNODE_GPU_PAD_ROWS", value)
        assert gpu_pad_rows() == pad
    warned = [r.getMessage() for r in caplog.records if "MESHNODE_GPU_PAD_ROWS" in r.getMessage()]
    assert any("'9' is not a number in 2..8" in m for m in warned) and any("'x'" in m for m in warned)
    assert not any("'8'" in m or "''" in m for m in warned)


def test_the_cap_keeps_narrower_settings_and_stays_a_valid_policy():
    from meshnode.spec.window import cap_for_route

    narrow = WindowPolicy("adaptive", 2, 1, 3)
    assert cap_for_route(narrow, _route("cuda")) is narrow
    fixed = WindowPolicy("fixed", 8, 8, 8)
    assert cap_for_route(fixed, _route("cuda")) == WindowPolicy("fixed", 3, 3, 3)
    make_window(cap_for_route(WindowPolicy("adaptive", 16, 16, 32), _route("cuda")))   # validates


def test_the_windows_follow_the_current_route():
    """A re-plan that moves the route onto a GPU stage narrows the windows chosen at start;
    one that moves it off widens them back to the configured ones."""
    from meshnode.spec.strategy import CliSpecOptions, RouteWindows, resolve_strategy

    spec = resolve_strategy("m", cli=CliSpecOptions(strategy="ngram"))
    route = RouteWindows(spec)
    assert not route.follow(_route("cpu", "cpu")) and route.config is spec    # start: a CPU route
    assert route.follow(_route("cpu", "cuda"))                                # re-planned onto a GPU stage
    assert route.config.window.max == 3
    win = make_window(route.config.window)
    for _ in range(8):                       # full acceptance cannot grow it past the cap
        win.update(win.next_window(), win.next_window())
        assert win.next_window() <= 3
    assert not route.follow(_route("cuda"))        # the same bounds: nothing to redo
    assert route.follow(_route("cpu"))             # and back onto CPUs
    assert route.config.window == spec.window


def test_speculation_off_stays_off_on_any_route():
    from meshnode.spec.strategy import CliSpecOptions, RouteWindows, resolve_strategy

    off = resolve_strategy("m", cli=CliSpecOptions(mode="off"))
    for spec in (off, None):
        route = RouteWindows(spec)
        assert not route.follow(_route("cuda")) and route.config is spec


def test_the_strategy_is_capped_when_a_stage_of_the_route_runs_on_cuda():
    from meshnode.spec.strategy import CliSpecOptions, exact_for_route, resolve_strategy

    spec = resolve_strategy("m", cli=CliSpecOptions(strategy="ngram"))
    assert spec.enabled and spec.window.max > 3
    assert exact_for_route(spec, _route("cpu", "cuda")).window.max == 3
    assert exact_for_route(spec, _route("cpu", "cpu")) is spec
    off = resolve_strategy("m", cli=CliSpecOptions(mode="off"))
    assert exact_for_route(off, _route("cuda")) is off
    assert exact_for_route(None, _route("cuda")) is None


def _n_kv(cells: int) -> int:
    """llama.cpp's attended KV length for a sequence whose cells 0..cells-1 are in use
    (llama_kv_cache::get_n_kv, a cache large enough)."""
    from meshnode.limits import KV_BUCKET

    return max(KV_BUCKET, -(-cells // KV_BUCKET) * KV_BUCKET)


@pytest.mark.parametrize("pad", [1, 2, 4, 5, 8])
def test_a_window_within_the_bucket_rule_attends_what_each_rows_own_step_attends(pad):
    """What the rule is for: every row of a window of ``k`` drafts at ``pos`` (cells up to
    pos + max(k + 1, pad)) attends the same KV length as its own padded one-row step
    (cells up to its position + pad); one draft more would break that for the last row."""
    from meshnode.limits import gpu_bucket_drafts

    for pos in range(0, 1100):
        room = gpu_bucket_drafts(pos, pad)
        assert 0 <= room < 256
        for k in range(0, min(room, 16) + 1):
            window = _n_kv(pos + max(k + 1, pad))
            assert all(_n_kv(pos + j + pad) == window for j in range(k + 1)), (pos, k)
        k = room + 1   # the first window the rule refuses
        assert _n_kv(pos + max(k + 1, pad)) != _n_kv(pos + k + pad) or \
            _n_kv(pos + pad) != _n_kv(pos + k + pad), (pos, k)


def test_the_bucket_rule_cuts_windows_only_on_gpu_stages_and_at_the_narrowest():
    from meshnode.limits import MAX_VERIFY_WINDOW
    from meshnode.spec.window import drafts_at

    # pad 2 (the default, also for a node that did not say): a one-row step at 1022 fills
    # cells up to 1024, the bucket's edge: no drafts there; one position on, a fresh bucket
    assert [drafts_at(p, _route("cpu", "cuda")) for p in (1019, 1020, 1021, 1022, 1023)] == [3, 2, 1, 0, 255]
    assert drafts_at(1020, _route("cuda", pad=0)) == 2
    # each stage by its own pad; the route by its narrowest stage
    assert drafts_at(1016, _route("cuda", pad=8)) == 0 and drafts_at(1016, _route("cuda", pad=2)) == 6
    assert drafts_at(1016, [_Stage("cuda", 8), _Stage("cuda", 2)]) == 0
    assert drafts_at(1020, [_Stage("cuda", 8), _Stage("cpu", 0), _Stage("cuda", 2)]) == 2
    for route in (_route("cpu", "cpu"), _route("", "cpu"), []):
        assert drafts_at(1022, route) == MAX_VERIFY_WINDOW


def test_the_route_windows_apply_the_bucket_rule_of_the_current_route():
    from meshnode.spec.strategy import CliSpecOptions, RouteWindows, resolve_strategy

    route = RouteWindows(resolve_strategy("m", cli=CliSpecOptions(strategy="ngram")))
    route.follow(_route("cpu", "cpu"))
    assert route.drafts_at(1022) >= 16
    route.follow(_route("cpu", "cuda"))
    assert route.drafts_at(1022) == 0 and route.drafts_at(1023) == 255


def test_a_replay_chunk_is_as_wide_as_the_route_computes_like_one_row_steps():
    """A failover's replay of generated tokens (serve/failover.py) takes chunks of the
    route's exact width whatever speculation is set to: on a GPU stage 4 rows (pad 2), cut
    at the KV bucket its one-row steps fill; on CPU stages the batch-invariance bound."""
    from meshnode.limits import MAX_VERIFY_WINDOW
    from meshnode.spec.strategy import CliSpecOptions, RouteWindows, resolve_strategy

    for spec in (resolve_strategy("m", cli=CliSpecOptions(mode="off")), None,
                 resolve_strategy("m", cli=CliSpecOptions(strategy="ngram"))):
        route = RouteWindows(spec)
        route.follow(_route("cpu", "cpu"))
        assert route.exact_rows_at(1022) == MAX_VERIFY_WINDOW
        route.follow(_route("cpu", "cuda"))
        assert [route.exact_rows_at(p) for p in (1000, 1019, 1020, 1021, 1022, 1023)] == [4, 4, 3, 2, 1, 4]
        route.follow(_route("cuda", pad=8))
        assert route.exact_rows_at(100) == 8 and route.exact_rows_at(1016) == 1
