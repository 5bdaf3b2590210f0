"""Node routes: ``GET /health`` and ``GET /status`` (the JSON behind ``meshnode status``).

``/status`` is a stable interface for scripts: ``{"node": {...}, "peers": [...]}``; each
peer has at least ``node_id``, ``name``, ``address``, ``rtt_ms``, ``authenticated`` and
``capabilities``. Fields are only ever added.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from fastapi import APIRouter, HTTPException, Request

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from meshnode.serve.openai_routes import POST_ERRORS, error_responses


class PullRequest(BaseModel):
    """``POST /mesh/pull``: a model the members share, by name or sha256."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    model: str = Field(max_length=128)
    from_: str | None = Field(default=None, alias="from", max_length=128)   # one holder's name or id
    layers: list[int] | None = Field(default=None, min_length=2, max_length=2)   # [a, b): a layer package


class RefreshRequest(BaseModel):
    """``POST /mesh/refresh``: no fields."""

    model_config = ConfigDict(extra="forbid")


def _post(model: type, ok: str, media: str = "application/json") -> dict[str, Any]:
    """A node route's POST documentation: its JSON body and every error it can answer."""
    return dict(responses={200: {"description": ok, "content": {media: {"schema": {"type": "object"}}}},
                           **error_responses(POST_ERRORS)},
                openapi_extra={"requestBody": {"required": True, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}})

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
        "status": str(snapshot.status),
        "status_detail": snapshot.status_detail,
        "failovers": to_jsonable(snapshot.failovers),
        # long work under way: the model's fetch, hashing, slicing, pulls (bytes done of total)
        "progress": to_jsonable(snapshot.transfers),
        "stages": [
            {"index": s.index, "node_id": s.node_id, "node": s.node_name,
             "layers": [s.layer_start, s.layer_end], "state": s.state.value, "detail": s.detail,
             "backend": s.backend, "gpu_pad_rows": s.gpu_pad_rows,
             "threads": s.threads, "max_threads": s.max_threads}
            for s in snapshot.stages
        ],
        "requests": to_jsonable(snapshot.requests[:20]),
        "spec": [dict(to_jsonable(s), acceptance=s.acceptance) for s in snapshot.spec],
        "mesh_models": to_jsonable(getattr(snapshot, "mesh_models", ())),
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
    server = getattr(getattr(node, "service", None), "server", None)
    if server is not None:   # KV held for the model this node coordinates (stage 0)
        data["model_sessions"] = server.sessions_held
        data["prefix_cache"] = server.prefix_stats()
    share = getattr(node, "mesh_share", None)
    if share is not None:   # requests carried to members, and members' served here
        data["mesh_requests"] = dict(share.counters)
    share = getattr(node, "share", None)
    if share is not None:   # pulls in progress: bytes done of total, rate, ETA
        data["transfers"] = [t.as_dict() for t in share.transfers.values()]
    return data


def _sharing_node(request: Request) -> Any:
    """The node, when it runs model sharing (503 otherwise: an embedding without it)."""
    node = request.app.state.node
    if getattr(node, "share", None) is None or getattr(node, "fabric", None) is None:
        raise HTTPException(503, "model sharing is not running on this node")
    return node


@router.get("/mesh/models", responses=error_responses((401, 403, 500, 503)))
async def mesh_models_route(request: Request) -> dict[str, Any]:
    """Models the members share (``meshnode models list --mesh``)."""
    from meshnode.mesh.share import mesh_models

    node = _sharing_node(request)
    transfers = [t.as_dict() for t in node.share.transfers.values()]
    return {"models": mesh_models(node.fabric), "transfers": transfers}


@router.post("/mesh/refresh", **_post(RefreshRequest, "advertised again"))
async def mesh_refresh_route(request: Request) -> dict[str, Any]:
    """Advertise the store again (after ``meshnode models share|unshare|rm``)."""
    _sharing_node(request).advertise_models()
    return {"ok": True}


@router.post("/mesh/pull", **_post(PullRequest, "progress lines, then the result", "application/x-ndjson"))
async def mesh_pull_route(request: Request) -> Any:
    """Pull a shared model into this node's store (``meshnode models pull``), or with
    ``"layers": [a, b]`` the layer package of blocks [a, b) into the slice cache: one JSON
    line per progress step, then ``{"path": ...}`` or ``{"error": ...}``. A client that
    goes away cancels the pull (the part file stays for a resume)."""
    import asyncio
    import json

    from fastapi.responses import StreamingResponse

    from meshnode.mesh.share import resolve_mesh_model
    from meshnode.models.errors import ModelFileError
    from meshnode.models.index import vouch_for
    from meshnode.models.transfer import TransferError

    node = _sharing_node(request)
    try:
        body = PullRequest.model_validate(await request.json())
        entry, sources = resolve_mesh_model(node.fabric, body.model, body.from_)
        layers = body.layers
        if layers is not None:
            start, end = layers
            if not 0 <= start < end <= entry["n_layers"]:
                raise TransferError(f"layers [{start}, {end}) are outside the model's {entry['n_layers']} layers")
    except ValidationError as exc:
        first = exc.errors()[0]
        return _line_error(f"bad request: {'.'.join(map(str, first['loc'])) or 'body'}: {first['msg']}")
    except (ValueError, AttributeError, TypeError) as exc:
        return _line_error(f"bad request: {exc}")
    except TransferError as exc:
        return _line_error(str(exc))
    from meshnode.models.slicer import SliceCache

    cache = SliceCache(node.paths)
    if layers is None:
        dest = node.paths.models / f"{entry['name'].replace('/', '_')}.gguf"
    else:
        dest = cache.package_path(entry["sha256"], start, end, entry["n_layers"])
    queue: asyncio.Queue = asyncio.Queue()

    async def run() -> None:
        try:
            if dest.exists():
                raise TransferError(f"{dest.name} is already here ({dest})")
            path, _ = await node.share.pull(entry["sha256"], dest, sources=sources, whole=layers is None,
                                            layer_start=start if layers else 0, layer_end=end if layers else 0,
                                            name=entry["name"], progress=lambda p: queue.put_nowait(
                                                {"done": p.done, "total": p.total, "rate": p.rate, "eta_s": p.eta_s}))
            if layers is None:
                # the pull checked the sha256: record it now, before the store is listed
                await asyncio.to_thread(vouch_for, path, entry["sha256"], entry["name"])
                node.advertise_models()
            else:
                await asyncio.to_thread(cache.adopt, path, entry["sha256"], entry["name"], start, end,
                                        entry["n_layers"])
            queue.put_nowait({"path": str(path), "name": entry["name"], "sha256": entry["sha256"]})
        except TransferError as exc:
            queue.put_nowait({"error": str(exc)})
        except ModelFileError as exc:
            queue.put_nowait({"error": f"the pulled file is not a model this node can load: {exc}"})

    async def lines() -> Any:
        task = asyncio.get_running_loop().create_task(run())
        try:
            while True:
                item = await queue.get()
                yield (json.dumps(item) + "\n").encode()
                if "path" in item or "error" in item:
                    return
        finally:
            if not task.done():
                task.cancel()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _line_error(message: str) -> Any:
    """A refused pull, as every route's errors are (OpenAI's error object)."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": None}}, status_code=400)
