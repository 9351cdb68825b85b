"""Request bodies Claude Code and Codex really sent (trimmed; tests/agents/data/README.md says how),
played against the server (fake core, real uvicorn server), every answer checked against the official
SDKs' types in strict mode: Anthropic's Message / stream events / error, OpenAI's Response (usage with
cache_write_tokens) / Responses stream events / error."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from metalserve.api.settings import ServerSettings
from tests.api.conftest import MODEL, Served, live, make_served

DATA = Path(__file__).parent / "data"
ANTHROPIC_EVENT: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
RESPONSES_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"}
OVERFLOW = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)")


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    """A 32,768-token fake context: Claude Code's recorded max_tokens 32000 overflows it, as on the real
    server."""
    settings = ServerSettings(tool_call_parser="hermes", enable_auto_tool_choice=True, log_stats_interval=0)
    with live(make_served(settings, max_model_len=32768)) as served:
        yield served


def _load(name: str) -> dict[str, Any]:
    body = json.loads((DATA / name).read_text())
    return {**body, "model": MODEL}


def _strict(model: type[BaseModel], text: str) -> Any:
    return model.model_validate_json(text, strict=True)


def _sse(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]


def _post(served: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, headers=HEADERS, timeout=120)


def test_claude_code_first_turn(server: Served) -> None:
    """As recorded (stream, max_tokens 32000, adaptive thinking, context_management, output_config,
    metadata, cache_control): the overflow error, then the retry Claude Code makes from its numbers."""
    body = _load("claude_code_messages.json")
    assert body["stream"] and body["max_tokens"] == 32000 and body["thinking"]["type"] == "adaptive"
    refused = _post(server, "/v1/messages?beta=true", body)
    assert refused.status_code == 400 and refused.headers["x-should-retry"] == "false"
    error = _strict(ErrorResponse, refused.text)
    match = OVERFLOW.search(error.error.message)
    assert match is not None and int(match.group(3)) == 32768
    room = 32768 - int(match.group(1))
    streamed = _post(server, "/v1/messages?beta=true", {**body, "max_tokens": room})
    assert streamed.status_code == 200
    # `ping` is Anthropic's keep-alive, outside the SDK's event union (its stream reader skips it).
    events = [ANTHROPIC_EVENT.validate_json(d, strict=True) for d in _sse(streamed) if '"type": "ping"' not in d]
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    whole = _post(server, "/v1/messages", {**body, "max_tokens": room, "stream": False})
    message = _strict(Message, whole.text)
    assert message.usage.cache_read_input_tokens and message.usage.cache_read_input_tokens > 0
    counted = _post(server, "/v1/messages/count_tokens", {k: body[k] for k in ("model", "messages", "system", "tools")})
    assert counted.json()["input_tokens"] == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_claude_code_tool_result_turn(server: Served) -> None:
    """The recorded first turn continued with a Read call and its result, as Claude Code sends them."""
    body = copy.deepcopy(_load("claude_code_messages.json"))
    use = {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"file_path": "/tmp/work/hello.txt"}}
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_01",
        "content": "     1\tThe secret word is pineapple.\n",
        "cache_control": {"type": "ephemeral"},
    }
    body["messages"] += [{"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    fields = {k: body[k] for k in ("messages", "system", "tools", "metadata", "thinking")}
    extra = {k: body[k] for k in ("context_management", "output_config")}  # beta fields the SDK leaves to us
    with client.messages.stream(model=MODEL, max_tokens=64, extra_body=extra, **fields) as stream:
        final = stream.get_final_message()  # the SDK's own parse of every raw event
    _strict(Message, final.model_dump_json())
    prompt = server.engine.tokenizer.decode(server.core.added[-1].prompt_token_ids)
    assert "The secret word is pineapple." in prompt


def test_claude_code_web_search_is_refused_in_anthropics_shape(server: Served) -> None:
    """Claude Code's WebSearch tool asks the API for its server-side web_search tool: not offered here."""
    body = _load("claude_code_web_search.json")
    refused = _post(server, "/v1/messages?beta=true", body)
    assert refused.status_code == 400 and refused.headers["x-should-retry"] == "false"
    error = _strict(ErrorResponse, refused.text)
    assert "tools.0" in error.error.message


def test_codex_turns(server: Served) -> None:
    """Codex's recorded request (no max_output_tokens, reasoning, include, prompt_cache_key,
    client_metadata), streamed: every event and the final Response parse strictly."""
    body = _load("codex_responses.json")
    assert "max_output_tokens" not in body
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)
    assert response.status_code == 200, response.text
    events = [RESPONSES_EVENT.validate_json(data, strict=True) for data in _sse(response)]
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert final.response.usage.input_tokens_details.cache_write_tokens == 0
    # Codex sends store: false, so nothing is kept to read back.
    assert httpx.get(f"{server.url}/v1/responses/{final.response.id}").status_code == 404
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    extra = {"client_metadata": body["client_metadata"]}  # Codex's own field, not in the SDK's signature
    made = oai.responses.create(**{k: v for k, v in body.items() if k not in ("stream", *extra)}, extra_body=extra)
    _strict(Response, made.model_dump_json())


def test_codex_web_search_is_refused_in_openais_shape(server: Served) -> None:
    body = _load("codex_responses.json")
    body["tools"] = [*body.get("tools", []), {"type": "web_search", "external_web_access": False}]
    refused = httpx.post(f"{server.url}/v1/responses", json=body)
    assert refused.status_code == 400 and refused.headers["x-should-retry"] == "false"
    error = _strict(openai.types.ErrorObject, json.dumps(refused.json()["error"]))
    assert error.param is not None and error.param.startswith("tools")
