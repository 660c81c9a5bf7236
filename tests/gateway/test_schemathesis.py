"""Property-based fuzzing of every operation in the gateway's own OpenAPI document.

schemathesis generates requests from `/openapi.json` (valid and invalid bodies, query
strings and path ids) and sends them to the live gateway of the `stack` fixture as
tenant-b. Every answer must be no server error, carry a documented status and content
type, and match its documented schema (errors: the OpenAI envelope, never FastAPI's 422).

Deterministic for CI: hypothesis is derandomized (a fixed seed per test) with a fixed,
small number of examples, and there is no deadline (the machine is slow). Generation
lengths are capped so that no example asks the tiny model for thousands of tokens: the
run is about the API's contract, not the model's speed.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.gateway.conftest import Stack

KEY = "key-b"  # tenant-b: the sessions it creates are its own
MAX_GENERATED = 4  # tokens per example at most
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


# The document the gateway serves, built without serving it (schemathesis parametrizes
# at import time); test_the_served_document_is_this_one checks it is the live one.
DOC = create_app(GatewaySettings()).openapi()
schema = schemathesis.openapi.from_dict(DOC)


def test_the_served_document_is_this_one(stack: Stack) -> None:
    assert httpx.get(f"{stack.url}/openapi.json", timeout=60).json() == DOC


def steer(body: Any) -> None:
    """Name the served model (a random name only ever meets `model_not_found`), and keep
    examples cheap: at most MAX_GENERATED new tokens. Only values of
    the right type are changed, so an invalid example stays invalid."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str) and 0 < len(body["model"]) <= 256:
        body["model"] = "tiny"
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(field)
        if type(value) is int and value > MAX_GENERATED:
            body[field] = MAX_GENERATED
    # absent or null: up to the whole window (`max_output_tokens`: a /v1/responses body)
    limit = "max_output_tokens" if "input" in body else "max_tokens"
    if body.get(limit) is None:
        body[limit] = MAX_GENERATED


@pytest.mark.slow  # fuzzing, 12-25 s: make test-slow; test_hostile.py's cases stay
@schema.parametrize()
@settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_gateway_api(stack: Stack, case: Any) -> None:
    steer(case.body)
    case.call_and_validate(
        base_url=stack.url, headers={"authorization": f"Bearer {KEY}"}, checks=CHECKS, timeout=120
    )
