"""Schemathesis against the served OpenAPI document: generated requests for
every operation never get a 5xx, and every answer conforms to the document
(status codes, content types, headers, bodies)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.integration.test_api_support import api_settings, worker_loop
from vlmq.config.settings import Settings
from vlmq.producers.api.app import create_app

LOOPBACK = "localhost"

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def _operations() -> list[tuple[str, str, GenerationMode]]:
    """(METHOD, path, mode) of every documented operation (building the app connects
    nothing); operations without inputs have no invalid requests to generate."""
    document = create_app(Settings(redis_url="redis://127.0.0.1:1/0")).openapi()
    cases = []
    for path, item in document["paths"].items():
        for method, operation in item.items():
            cases.append((method.upper(), path, GenerationMode.POSITIVE))
            if operation.get("parameters") or operation.get("requestBody"):
                cases.append((method.upper(), path, GenerationMode.NEGATIVE))
    return cases


@pytest.fixture
def api_schema(redis_server, moto_server, request):
    settings = api_settings(
        redis_server,
        moto_server,
        request.node.name,
        rate_limit_per_s=1e6,
        rate_limit_burst=10**6,
        max_batch_items=20,
        sync_timeout_s=30,
    )
    # A keyless server answers loopback Host names only (schemathesis sends "testserver").
    schema = schemathesis.openapi.from_asgi(
        "/openapi.json", create_app(settings), headers={"Host": LOOPBACK}
    )
    if request.node.callspec.params["path"] != "/v1/chat/completions":
        yield schema
        return
    # A chat completion answers when its task ends: a worker runs the valid ones.
    with worker_loop(settings):
        yield schema


@pytest.mark.parametrize(("method", "path", "mode"), _operations())
def test_every_operation_conforms(api_schema, method, path, mode):
    """Valid and invalid (schema-violating) requests alike: never a 5xx, never off-document."""
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis_settings(
        max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    def conforms(case):
        case.call_and_validate(base_url=f"http://{LOOPBACK}", checks=CHECKS)

    conforms()
