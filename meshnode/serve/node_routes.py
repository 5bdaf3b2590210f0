"""Node routes: ``GET /health`` and ``GET /status`` (the JSON behind ``meshnode status``).

``/status`` is a stable interface for scripts: ``{"node": {...}, "peers": [...]}``; each
peer has at least ``node_id``, ``name``, ``address``, ``rtt_ms``, ``authenticated`` and
``capabilities``. Fields are only ever added.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from fastapi import APIRouter, Request

from meshnode.serve.openai_routes import error_responses

router = APIRouter()


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    return obj


def status_json(snapshot: Any) -> dict[str, Any]:
    return {
        "node": to_jsonable(snapshot.node),
        "peers": to_jsonable(snapshot.peers),
        "model": snapshot.model,
        "stages": [
            {"index": s.index, "node_id": s.node_id, "node": s.node_name,
             "layers": [s.layer_start, s.layer_end], "state": s.state.value, "detail": s.detail,
             "backend": s.backend}
            for s in snapshot.stages
        ],
        "requests": to_jsonable(snapshot.requests[:20]),
        "spec": [dict(to_jsonable(s), acceptance=s.acceptance) for s in snapshot.spec],
    }


@router.get("/health", responses=error_responses((403, 500)))
async def health(request: Request) -> dict[str, Any]:
    node = request.app.state.node
    fabric = getattr(node, "fabric", None)
    service = getattr(node, "service", None)
    return {"status": "ok", "node_id": fabric.node_id if fabric is not None else None,
            "model": None if service is None else {"state": service.state, "detail": service.detail}}


@router.get("/status", responses=error_responses((401, 403, 500)))
async def status(request: Request) -> dict[str, Any]:
    node = request.app.state.node
    data = status_json(node.snapshot())
    stage_server = getattr(node, "stage_server", None)
    if stage_server is not None:
        data["stage_sessions"] = stage_server.sessions()
    return data
