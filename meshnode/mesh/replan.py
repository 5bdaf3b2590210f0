"""Re-planning decisions: which plans to try after a stage is lost, and when a member
that came back is worth a new plan. Pure logic (no I/O, no clock).

After a loss the coordinator tries, in order, the options the model was started with
(another node that holds the model takes the missing range), then fewer forced stages,
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

from meshnode.mesh.planner import Plan

__all__ = ["fallback_options", "plan_key", "upgrade_wanted"]


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
