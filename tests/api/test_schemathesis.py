"""Property-based requests generated from the app's own /openapi.json: none may give a 5xx."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings

from tests.api.conftest import make_served

schema = schemathesis.openapi.from_asgi("/openapi.json", make_served().app)


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case) -> None:
    response = case.call()
    assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400 and case.path.startswith("/v1/messages"):
        body = response.json()  # Anthropic's routes answer in Anthropic's shape
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    elif response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
