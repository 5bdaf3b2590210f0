"""Re-planning decisions: which plans to try after a stage is lost, and when a member
that came back is worth a new plan. Pure logic (no I/O, no clock).

After a loss the coordinator tries, in order, the options the model was started with
(another node that holds the model takes the missing range: :func:`substitute` keeps
every layer range as it was, so stage 0 and the stages that survive reuse their cached
slices, and a node that served a range before finds it in its own cache), then a fresh
plan with those options, then fewer forced stages,
then the planner's own choice over whoever remains (which may be the coordinator
alone, when the model fits its memory budget). A forced layout (``--split``,
``--stages``) that the remaining members cannot form is relaxed rather than leaving
the model without a route.

A model serving on such a fallback plan is *degraded*: when a member joins, the
coordinator plans again with the original options and switches once the model is
idle, if that plan differs from the one serving (:func:`upgrade_wanted`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from collections.abc import Sequence

from meshnode.mesh.planner import DEFAULT_HEADROOM, Candidate, Plan, PlannedStage

__all__ = ["fallback_options", "plan_key", "substitute", "upgrade_wanted"]

MOVED = "; ranges kept, lost stages moved"


def fallback_options(options: Any) -> list[Any]:
    """The :class:`~meshnode.mesh.runtime.ServeOptions` to plan with after a loss, in
    order: ``options`` itself, then ``--split N-1 .. 2``, then the planner's choice
    (an explicit ``--stages`` layout goes straight to the planner's choice)."""
    out = [options]
    if options.explicit is not None:
        out.append(dataclasses.replace(options, explicit=None, split=None))
    elif options.split is not None:
        out += [dataclasses.replace(options, split=n) for n in range(options.split - 1, 1, -1)]
        out.append(dataclasses.replace(options, split=None))
    return out


def plan_key(plan: Plan) -> tuple[tuple[str, int, int], ...]:
    """What makes two plans the same route: each stage's node and layer range."""
    return tuple((s.node_id, s.start, s.end) for s in plan.stages)


def upgrade_wanted(current: Plan | None, desired: Plan) -> bool:
    """Whether to switch a degraded model from ``current`` to ``desired`` (the plan its
    original options give now): only when the route would change."""
    return current is None or plan_key(current) != plan_key(desired)


def substitute(plan: Plan, candidates: Sequence[Candidate], *,
               headroom: float = DEFAULT_HEADROOM) -> Plan | None:
    """``plan`` with each stage whose node is not among ``candidates`` moved, layer range
    and all, to a candidate outside the plan that has the memory for it (the largest
    capacity first, then the node id: deterministic). None when a stage finds no such
    node, or when the coordinator itself is gone."""
    by_id = {c.node_id: c for c in candidates}
    if plan.stages[0].node_id not in by_id:
        return None
    used = {s.node_id for s in plan.stages if s.node_id in by_id}
    stages: list[PlannedStage] = []
    moved = []
    for st in plan.stages:
        if st.node_id in by_id:
            stages.append(st)
            continue
        fits = [c for c in candidates if c.node_id not in used and not c.is_coordinator
                and st.est_bytes * (1.0 + headroom) <= c.capacity]
        if not fits:
            return None
        best = min(fits, key=lambda c: (-c.capacity, c.node_id))
        used.add(best.node_id)
        moved.append(f"{st.name} -> {best.name}")
        stages.append(dataclasses.replace(st, node_id=best.node_id, name=best.name))
    if not moved:
        return plan
    # (the reason says the last move only: a plan moved at every failover would otherwise
    # carry the whole history in its log line)
    base = plan.reason.partition(MOVED)[0]
    return dataclasses.replace(plan, stages=tuple(stages), reason=f"{base}{MOVED} ({', '.join(moved)})")
