"""The output budget of a request that sets none: the server's --default-max-tokens in all three APIs,
and the Responses API telling the end of the context from an output cap (fake core, real server, the
openai SDK's own types in strict mode)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response

from metalserve.api.settings import ServerSettings
from tests.api.conftest import Served, live, make_served

# The fake core repeats what follows "say:"; this reply (with its prompt) is longer than the 256-token context.
LONG_SAY = "say:" + "Paris is the capital of France. " * 10


@pytest.fixture(scope="module")
def capped() -> Iterator[Served]:
    settings = ServerSettings(log_stats_interval=0, default_max_tokens=3)
    with live(make_served(settings)) as served:
        yield served


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def test_default_cap_in_every_api(capped: Served) -> None:
    url, hi = capped.url, [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": hi}).json()
    assert chat["usage"]["completion_tokens"] == 3 and chat["choices"][0]["finish_reason"] == "length"
    completion = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": None}).json()
    assert completion["usage"]["completion_tokens"] == 3
    # A client's own max_tokens is honoured, above the default cap too.
    asked = httpx.post(f"{url}/v1/chat/completions", json={"messages": hi, "max_tokens": 5}).json()
    assert capped.core.added[-1].sampling_params.max_tokens == 5 and asked["usage"]["completion_tokens"] == 5
    text = httpx.post(f"{url}/v1/responses", json={"input": "Hi"}).text
    body = Response.model_validate_json(text, strict=True)
    assert body.status == "incomplete" and body.usage is not None and body.usage.output_tokens == 3
    assert json.loads(text)["incomplete_details"] == {"reason": "max_output_tokens", "cause": "default_max_tokens"}


def test_context_end_is_told_apart(server: Served) -> None:
    """The default server (cap 4096 > the fake's 256-token context): the context ends first."""
    text = httpx.post(f"{server.url}/v1/responses", json={"input": LONG_SAY}).text
    body = Response.model_validate_json(text, strict=True)
    assert body.status == "incomplete" and body.usage is not None
    assert body.usage.input_tokens + body.usage.output_tokens == 256
    assert json.loads(text)["incomplete_details"]["cause"] == "context_window"
    assert body.usage.input_tokens_details.cache_write_tokens == 0
    streamed = _events(httpx.post(f"{server.url}/v1/responses", json={"input": LONG_SAY, "stream": True}))
    assert streamed[-1]["type"] == "response.incomplete"
    assert streamed[-1]["response"]["incomplete_details"]["cause"] == "context_window"
    Response.model_validate_json(json.dumps(streamed[-1]["response"]), strict=True)
    capped_by_client = httpx.post(f"{server.url}/v1/responses", json={"input": LONG_SAY, "max_output_tokens": 4})
    assert capped_by_client.json()["incomplete_details"]["cause"] == "max_output_tokens"


def test_sdk_parses_responses_strictly(server: Served) -> None:
    """openai 3.57 requires usage.input_tokens_details.cache_write_tokens: the SDK's parse, the stored copy
    and the completed event all validate."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    made = client.responses.create(model="tiny-model", input="Hi", max_output_tokens=4)
    assert made.usage is not None and made.usage.input_tokens_details.cache_write_tokens == 0
    stored = httpx.get(f"{server.url}/v1/responses/{made.id}").text
    Response.model_validate_json(stored, strict=True)
    with client.responses.stream(model="tiny-model", input="Hi") as stream:
        final = stream.get_final_response()
    Response.model_validate_json(final.model_dump_json(), strict=True)
