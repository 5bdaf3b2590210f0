"""The node's HTTP app: ``create_app(node)``: node routes, the ``/v1`` routes, the guard.

Every request passes :class:`~meshnode.serve.http_guard.HttpGuard` first (Host, Origin,
API key, content type, admission, body cap), with the node's ``http_security``
(:class:`~meshnode.serve.http_guard.HttpSecurity`; loopback defaults when it has none).
CORS headers are sent only for the origins ``--cors-origin`` names: the CORS middleware
sits outside the guard, so a refusal still reaches an allowed page readably. No
interactive docs (``/docs`` would load scripts from a CDN); ``/openapi.json`` declares
every request body and every error response (:func:`openapi_document`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic.json_schema import models_json_schema

from meshnode import __version__
from meshnode.state import printable
from meshnode.serve.http_guard import HttpGuard, HttpSecurity
from meshnode.serve.node_routes import PullRequest, RefreshRequest
from meshnode.serve.schemas import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, InfillRequest, NativeCompletionRequest,
    TokenizeRequest,
)
from meshnode.serve.responses_api import ResponsesRequest

REQUEST_MODELS = (ChatCompletionRequest, CompletionRequest, ResponsesRequest, InfillRequest, NativeCompletionRequest,
                  TokenizeRequest, DetokenizeRequest, PullRequest, RefreshRequest)


def create_app(node: Any, security: HttpSecurity | None = None) -> FastAPI:
    from starlette.middleware.cors import CORSMiddleware

    from meshnode.serve.node_routes import router
    from meshnode.serve.openai_routes import make_openai_router

    security = security or getattr(node, "http_security", None) or HttpSecurity()
    app = FastAPI(title="meshnode", version=__version__, docs_url=None, redoc_url=None)
    app.state.node = node
    app.include_router(router)
    app.include_router(make_openai_router(lambda: node.engine_client, responses=getattr(node, "responses", None)))
    from meshnode.serve.mesh_share import MeshForwardMiddleware

    app.add_middleware(MeshForwardMiddleware, node=node)   # inside the guard: requests passed it
    app.add_middleware(HttpGuard, security=security)
    if security.cors_origins:   # added last: outermost
        app.add_middleware(CORSMiddleware, allow_origins=list(security.cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["authorization", "content-type"],
                           max_age=600)
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    app.add_exception_handler(StarletteHTTPException, _http_error)
    return app


# The OpenAI API's routes a node answers (what a 404 names)
SERVED = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models")


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own refusals (no such path, wrong method) in OpenAI's error shape too."""
    assert isinstance(exc, StarletteHTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = str(exc.detail)
    if exc.status_code == 404:
        # a client pointed at a route this server lacks (embeddings, audio) is told which
        # it has, not just "Not Found" (the path is the client's: shown printable, cut)
        path = printable(request.url.path, 120)
        message = (f"No route {request.method} {path} on this node: it serves {', '.join(SERVED)} "
                   "(every route: GET /openapi.json; docs/api.md). Embeddings, images and audio are not served.")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=exc.status_code, headers=exc.headers)



def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus what it cannot see: the request bodies the handlers parse
    by hand (their pydantic schemas under components), without FastAPI's 422 (validation
    errors are 400 here)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                 ref_template="#/components/schemas/{model}")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in defs.get("$defs", {}).items():
        schemas.setdefault(name, schema)
    for methods in doc.get("paths", {}).values():
        for op in methods.values():
            op.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    app.openapi_schema = doc
    return doc
