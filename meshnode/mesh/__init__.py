"""meshnode.mesh: membership, the stage planner and stage control.

* :mod:`meshnode.mesh.planner` -- pure: which nodes run which layer ranges (``plan()``).
* :mod:`meshnode.mesh.stage_control` -- sans-IO: the Claim -> Prepare -> Inventory ->
  Load -> Ready negotiation's parameters and events; its two machines are
  :mod:`~meshnode.mesh.stage_control_coordinator` (``CoordinatorControl``) and
  :mod:`~meshnode.mesh.stage_control_server` (``StageServerControl``).

Submodules are imported explicitly (``from meshnode.mesh.planner import plan``); this
package imports nothing eagerly so that ``meshnode.mesh.fabric`` (QUIC, via
``meshnode.net``) stays optional.
"""
