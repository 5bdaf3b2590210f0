"""The node's HTTP app: ``create_app(node)`` (node routes now; ``/v1`` routers are
added with ``app.include_router`` by the serving layer)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from meshnode import __version__


def create_app(node: Any) -> FastAPI:
    from meshnode.serve.node_routes import router
    from meshnode.serve.openai_routes import make_openai_router

    app = FastAPI(title="meshnode", version=__version__)
    app.state.node = node
    app.include_router(router)
    app.include_router(make_openai_router(lambda: node.engine_client))
    return app
