"""schemathesis against the node's real app over real HTTP (issue #17): the OpenAPI
document declares every request body and every error response, and requests generated
from it, valid and invalid (schemathesis' positive and negative modes), get no 5xx and
no answer the document does not declare. Bounded: a few examples per operation, no
deadline per example, the whole module well under the fast tier's budget.

The engine behind the app is the real ModelServer over the tiny model of
test_http_security (the real final-stage sampler on made-up logits), so a sampling value
the sampler cannot take would surface here as a 500."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from meshnode.mesh.share import ShareService
from meshnode.paths import NodePaths
from meshnode.serve.app import create_app
from inproc import serve_app
from test_http_security import StubNode

# schemathesis over every operation takes ~10 s: the slow tier.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]


class _NoPeers:
    """A fabric with no members yet: model sharing's routes answer from it."""

    node_id = "stub"
    capabilities: dict = {}

    def peers(self) -> list:
        return []


class _SharingStubNode(StubNode):
    def __init__(self, home, **kw) -> None:
        super().__init__(**kw)
        self.fabric = _NoPeers()
        self.share = ShareService(self.fabric, NodePaths.resolve(home))

    def advertise_models(self) -> None:
        pass


@pytest.fixture(scope="module")
def api_url(tmp_path_factory) -> Iterator[str]:
    yield from serve_app(create_app(_SharingStubNode(tmp_path_factory.mktemp("home"), n_ctx=64)))


@pytest.fixture(scope="module")
def api_schema(api_url: str):
    return schemathesis.openapi.from_url(api_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_the_api_answers_what_its_document_declares(case) -> None:
    case.call_and_validate(checks=CHECKS)


def test_every_route_declares_its_body_and_errors(api_schema) -> None:
    doc = api_schema.raw_schema
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            codes = set(op["responses"])
            assert {"403", "500"} | ({"401"} if path != "/health" else set()) <= codes, (method, path, codes)
            for code, resp in op["responses"].items():
                if code.startswith(("4", "5")):
                    assert resp["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
            if method == "post":
                assert {"400", "408", "413", "415", "429", "503"} <= codes
                body = op["requestBody"]
                assert body["required"] and list(body["content"]) == ["application/json"]
                ref = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
                assert ref in doc["components"]["schemas"]
