"""Fuzz every route with hostile text (lone surrogates, control characters) in every field: no 5xx, ever,
and a normal request succeeds after each case."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from tests.api.conftest import make_served

MSG = [{"role": "user", "content": "Hi"}]
TEMPLATES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": "tiny-model",
        "messages": MSG,
        "max_tokens": 3,
        "stop": ["x"],
        "user": "u",
        "cache_salt": "s",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "logit_bias": {"5": 1},
    },
    "/v1/completions": {"model": "tiny-model", "prompt": "Hi", "max_tokens": 3, "stop": "x", "cache_salt": "s"},
    "/tokenize": {"model": "tiny-model", "prompt": "Hi"},
    "/detokenize": {"model": "tiny-model", "tokens": [5, 6]},
    "/v1/messages": {
        "model": "tiny-model",
        "max_tokens": 3,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "stop_sequences": ["x"],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "metadata": {"user_id": "u"},
    },
    "/v1/messages/count_tokens": {"model": "tiny-model", "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/responses": {
        "model": "tiny-model",
        "input": [{"role": "user", "content": "Hi"}],
        "instructions": "Be brief.",
        "max_output_tokens": 3,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    },
}

# Text from every category, surrogates (Cs) and controls (Cc) included, which st.text leaves out by default.
any_text = st.text(st.characters(codec=None, categories=["Cs", "Cc", "Cf", "Co", "L", "N", "P", "S", "Z"]))
# Lone surrogates and controls are rare in any_text, so half the strings get one spliced in.
spliced = st.characters(codec=None, categories=["Cs", "Cc"])
hostile_text = any_text | st.builds(lambda a, c, b: a + c + b, any_text, spliced, any_text)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | hostile_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(hostile_text, inner, max_size=3),
    max_leaves=6,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, (*prefix, i))


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _replace(value[path[0]], path[1:], new)
    return copy


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(make_served().app, raise_server_exceptions=False) as c:
        yield c


@st.composite
def hostile_requests(draw: st.DrawFn) -> tuple[str, str]:
    route = draw(st.sampled_from(sorted(TEMPLATES)))
    template = TEMPLATES[route]
    path = draw(st.sampled_from(list(_paths(template))[1:]))
    new = draw(hostile_text if draw(st.booleans()) else json_values)
    return route, json.dumps(_replace(template, path, new))  # ensure_ascii: surrogates as \\uXXXX escapes


@given(case=hostile_requests())
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
def test_hostile_text_never_gives_a_5xx(client: TestClient, case: tuple[str, str]) -> None:
    route, body = case
    response = client.post(route, content=body, headers={"content-type": "application/json"})
    assert response.status_code < 500, f"{route} {body[:300]}: {response.status_code} {response.text[:300]}"
    if response.status_code >= 400 and route.startswith("/v1/messages"):  # Anthropic's error shape
        body_json = response.json()
        assert body_json["type"] == "error" and {"type", "message"} <= set(body_json["error"])
    elif response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    ok = client.post("/v1/completions", json={"prompt": "say:fine", "max_tokens": 5})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "fine"
    for path in ("/health", "/v1/models", "/version", "/metrics"):
        assert client.get(path).status_code == 200
