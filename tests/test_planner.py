"""Planner: pure function tests (no I/O)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.errors import MeshnodeError
from meshnode.mesh.planner import (
    Candidate,
    ModelShape,
    PlanError,
    StageAssignment,
    format_size,
    parse_explicit,
    parse_size,
    plan,
)

GB = 10**9
MB = 10**6


def model(n_layers: int = 30, layer: int = 300 * MB, **kw) -> ModelShape:
    defaults = dict(embed_bytes=500 * MB, head_bytes=500 * MB, n_embd=2048, n_ctx=4096, kv_bytes_per_token=0)
    defaults.update(kw)
    return ModelShape(n_layers=n_layers, layer_bytes=layer, **defaults)  # type: ignore[arg-type]


def coord(mem: float, **kw) -> Candidate:
    return Candidate("n0", "coord", int(mem * GB), is_coordinator=True, **kw)


def peer(i: int, mem: float, **kw) -> Candidate:
    return Candidate(f"n{i}", f"peer{i}", int(mem * GB), **kw)


def covers(p, n: int) -> None:
    assert p.stages[0].start == 0 and p.stages[-1].end == n
    for a, b in zip(p.stages, p.stages[1:]):
        assert a.end == b.start and a.start < a.end


def check_fit(p, cands, headroom=0.1) -> None:
    by_id = {c.node_id: c for c in cands}
    for s in p.stages:
        assert s.est_bytes * (1 + headroom) <= by_id[s.node_id].capacity


# ---- sizes ---------------------------------------------------------------------


def test_model_total_counts_weights_kv_embed_head():
    m = ModelShape(n_layers=2, layer_bytes=[10, 20], embed_bytes=5, head_bytes=7, n_embd=4, n_ctx=8,
                   kv_bytes_per_token=3, overhead_bytes=1)
    assert m.kv_bytes_per_layer() == 24
    assert m.total_bytes == 10 + 20 + 2 * 24 + 5 + 7 + 1
    assert m.stage_bytes(1, 2, first=False, last=True) == 20 + 24 + 7 + 1


def test_default_kv_is_f16_without_gqa():
    m = ModelShape(n_layers=1, layer_bytes=0, embed_bytes=0, head_bytes=0, n_embd=576, n_ctx=2048)
    assert m.kv_bytes_per_layer() == 2 * 576 * 2 * 2048


def test_candidate_capacity_is_capped_by_budget():
    assert Candidate("a", "a", 8 * GB, budget=6 * GB).capacity == 6 * GB
    assert Candidate("a", "a", 4 * GB, budget=6 * GB).capacity == 4 * GB
    assert Candidate("a", "a", 4 * GB).capacity == 4 * GB


# ---- automatic plans -------------------------------------------------------------


def test_fits_on_coordinator_alone():
    m = model()  # 10 GB
    cands = [coord(16), peer(1, 64, speed=100.0)]
    p = plan(m, cands)
    assert [(s.node_id, s.start, s.end) for s in p.stages] == [("n0", 0, 30)]
    assert "alone" in p.reason


def test_budget_forces_a_split():
    m = model()
    p = plan(m, [coord(16, budget=6 * GB), peer(1, 16)])
    assert p.n_stages == 2
    assert p.stages[0].node_id == "n0"
    check_fit(p, [coord(16, budget=6 * GB), peer(1, 16)])


def test_too_big_two_stages_weighted_by_memory():
    m = model()  # 9 GB of layers + 1 GB embed/head
    cands = [coord(4), peer(1, 16)]
    p = plan(m, cands)
    covers(p, 30)
    assert [s.node_id for s in p.stages] == ["n0", "n1"]
    check_fit(p, cands)
    # equal speeds would share 15/15; the coordinator's memory caps it well below that
    assert p.stages[0].n_layers < 15 < p.stages[1].n_layers
    assert "2 stages" in p.reason


def test_three_stages_when_two_are_not_enough():
    m = model()
    cands = [coord(4), peer(1, 4), peer(2, 4), peer(3, 1)]
    p = plan(m, cands)
    assert p.n_stages == 3
    covers(p, 30)
    check_fit(p, cands)
    assert "n3" not in [s.node_id for s in p.stages]


def test_fewer_stages_preferred_over_speed():
    m = model()
    cands = [coord(4), peer(1, 16, speed=1.0), peer(2, 8, speed=10.0), peer(3, 8, speed=10.0)]
    p = plan(m, cands)
    assert p.n_stages == 2


def test_speed_weighting_gives_faster_node_more_layers():
    m = model()
    cands = [coord(12, speed=1.0), peer(1, 12, speed=3.0)]
    p = plan(m, cands, split=2)
    # memory is plentiful: layers follow speed (1:3 -> ~7.5 / 22.5)
    assert p.stages[0].n_layers in (7, 8)
    assert p.stages[1].n_layers in (22, 23)


def test_speed_picks_the_faster_peer():
    m = model()
    cands = [coord(4, speed=5.0), peer(1, 16, speed=1.0), peer(2, 16, speed=5.0)]
    p = plan(m, cands)
    assert [s.node_id for s in p.stages] == ["n0", "n2"]


def test_rtt_breaks_ties_between_equal_peers():
    m = model()
    cands = [coord(4), peer(1, 16, rtt_ms=9.0), peer(2, 16, rtt_ms=0.5)]
    assert [s.node_id for s in plan(m, cands).stages] == ["n0", "n2"]


def test_head_goes_to_a_node_that_can_hold_it():
    # peer 2 can only hold layers, not the 3 GB head: it must be a middle stage.
    m = model(head_bytes=3 * GB)
    cands = [coord(4.5), peer(1, 7.5), peer(2, 3.3)]
    p = plan(m, cands)
    check_fit(p, cands)
    assert p.stages[-1].node_id != "n2"


def test_varied_layer_sizes_respect_exact_fit():
    rng = random.Random(7)
    sizes = [rng.randrange(100 * MB, 600 * MB) for _ in range(40)]
    m = ModelShape(40, sizes, 400 * MB, 400 * MB, 2048, 2048, kv_bytes_per_token=8192)
    cands = [coord(5), peer(1, 7), peer(2, 6)]
    p = plan(m, cands)
    covers(p, 40)
    check_fit(p, cands)


# ---- --split ---------------------------------------------------------------------


def test_split_forces_n_stages_even_when_it_fits():
    m = model()
    cands = [coord(64), peer(1, 64), peer(2, 64)]
    p = plan(m, cands, split=3)
    assert p.n_stages == 3 and p.stages[0].node_id == "n0"
    assert [s.n_layers for s in p.stages] == [10, 10, 10]
    assert p.reason == "--split 3"


def test_split_one_is_the_coordinator():
    p = plan(model(), [coord(64), peer(1, 64)], split=1)
    assert [s.node_id for s in p.stages] == ["n0"]


def test_split_needs_enough_nodes():
    with pytest.raises(PlanError, match=r"--split 3 needs 3 nodes, 2 available"):
        plan(model(), [coord(64), peer(1, 64)], split=3)


def test_split_that_does_not_fit_says_how_much_is_missing():
    with pytest.raises(PlanError, match=r"--split 2: needs .* GB more memory across 2 nodes"):
        plan(model(), [coord(4), peer(1, 4), peer(2, 1)], split=2)


# ---- explicit --------------------------------------------------------------------


def test_parse_explicit():
    assert parse_explicit("nodeA=0:10, nodeB=10:30") == (StageAssignment("nodeA", 0, 10), StageAssignment("nodeB", 10, 30))
    for bad in ("nodeA", "nodeA=0-10", "=0:3", "a=x:3", ""):
        with pytest.raises(PlanError):
            parse_explicit(bad)


def test_explicit_by_name_and_id():
    cands = [coord(16), peer(1, 16)]
    p = plan(model(), cands, explicit="coord=0:12,n1=12:30")
    assert [(s.node_id, s.start, s.end) for s in p.stages] == [("n0", 0, 12), ("n1", 12, 30)]
    assert p.reason == "explicit"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("coord=0:10,peer1=12:30", r"leaves layers 10:12 unassigned"),
        ("coord=0:12,peer1=10:30", r"assigns layers 10:12 twice"),
        ("coord=0:10,peer1=10:31", r"out of bounds"),
        ("coord=0:10", r"leaves layers 10:30 unassigned"),
        ("peer1=0:10,coord=10:30", r"must start on the coordinator"),
        ("coord=0:10,ghost=10:30", r"'ghost'.*not an available node"),
        ("coord=0:10,peer1=10:20,coord=20:30", r"twice"),
        ("coord=0:28,peer1=28:30", r"coord needs .* more memory for layers 0:28"),
    ],
)
def test_explicit_errors(spec, message):
    cands = [coord(8), peer(1, 16)]
    with pytest.raises(PlanError, match=message):
        plan(model(), cands, explicit=spec)


def test_split_and_explicit_are_exclusive():
    with pytest.raises(PlanError):
        plan(model(), [coord(64)], split=1, explicit="coord=0:30")


# ---- refusals ----------------------------------------------------------------------


def test_impossible_says_how_much_more_memory():
    m = model()  # 10 GB -> 11 GB with 10 % headroom
    with pytest.raises(PlanError, match=r"needs 2\.0 GB more memory across the mesh") as exc:
        plan(m, [coord(4), peer(1, 5)])
    assert isinstance(exc.value, MeshnodeError)


def test_impossible_when_a_layer_fits_nowhere():
    m = model(n_layers=4, layer=3 * GB, embed_bytes=0, head_bytes=0)
    with pytest.raises(PlanError, match=r"layer 0 alone needs"):
        plan(m, [coord(3), peer(1, 3), peer(2, 3), peer(3, 3), peer(4, 3)])


def test_impossible_when_coordinator_cannot_hold_embeddings():
    m = model(embed_bytes=5 * GB)
    with pytest.raises(PlanError, match=r"coordinator coord needs .* embeddings"):
        plan(m, [coord(1), peer(1, 64)])


def test_caller_bugs_raise_value_error():
    with pytest.raises(ValueError):
        plan(model(), [peer(1, 64)])
    with pytest.raises(ValueError):
        plan(model(), [coord(64), Candidate("n0", "dup", GB)])


# ---- determinism -------------------------------------------------------------------


def test_deterministic_under_candidate_order():
    m = model()
    cands = [coord(4), peer(1, 8), peer(2, 8), peer(3, 8), peer(4, 3)]
    first = plan(m, cands, split=3)
    for seed in range(10):
        shuffled = cands[:]
        random.Random(seed).shuffle(shuffled)
        assert plan(m, shuffled, split=3) == first


@settings(max_examples=60, deadline=None)
@given(
    n_layers=st.integers(1, 48),
    mems=st.lists(st.floats(0.2, 12), min_size=1, max_size=5),
    speeds=st.lists(st.one_of(st.none(), st.floats(0.1, 10)), min_size=5, max_size=5),
)
def test_any_plan_covers_and_fits(n_layers, mems, speeds):
    m = model(n_layers=n_layers, layer=200 * MB, embed_bytes=100 * MB, head_bytes=100 * MB)
    cands = [coord(mems[0], speed=speeds[0])] + [peer(i, g, speed=speeds[i]) for i, g in enumerate(mems[1:], 1)]
    try:
        p = plan(m, cands)
    except PlanError as exc:
        assert str(exc)
        return
    covers(p, n_layers)
    check_fit(p, cands)
    assert p == plan(m, list(reversed(cands)))


# ---- CLI helpers -------------------------------------------------------------------


def test_parse_size():
    assert parse_size("6GB") == 6 * GB
    assert parse_size("6 gb") == 6 * GB
    assert parse_size("1.5G") == 1_500_000_000
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1024") == 1024
    for bad in ("", "GB", "6 parsecs", "-1GB"):
        with pytest.raises(MeshnodeError):
            parse_size(bad)


def test_format_size_rounds_up():
    assert format_size(2.01 * GB) == "2.1 GB"
    assert format_size(2 * GB) == "2.0 GB"
    assert format_size(0) == "0 B"


def test_fetch_time_prefers_a_holder_and_never_rules_a_non_holder_out():
    """A peer that lacks the model must fetch its layer package: the planner counts that
    time (package bytes over the peer's fetch bandwidth)."""
    m = model()
    holder, lacks = peer(1, 16, speed=1.0), peer(2, 16, speed=5.0, fetch_bytes_per_s=100 * MB)
    # the faster peer would win on speed alone; its download makes the holder the choice
    assert [s.node_id for s in plan(m, [coord(4, speed=5.0), holder, lacks]).stages] == ["n0", "n1"]
    # a holder without room: the non-holder serves (after its fetch)
    assert [s.node_id for s in plan(m, [coord(4), peer(1, 1), lacks]).stages] == ["n0", "n2"]
    # among non-holders the one that fetches faster
    slow = peer(3, 16, speed=5.0, fetch_bytes_per_s=10 * MB)
    assert [s.node_id for s in plan(m, [coord(4, speed=5.0), slow, lacks]).stages] == ["n0", "n2"]
    # the middle of a 3-stage split goes to the non-holder (no embedding, no head to fetch)
    p = plan(m, [coord(4), peer(1, 16), peer(2, 16, fetch_bytes_per_s=100 * MB)], split=3)
    assert [s.node_id for s in p.stages] == ["n0", "n2", "n1"]
