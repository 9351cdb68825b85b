"""The OpenAI Responses API over the fake core, through a real uvicorn server: httpx and the openai SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from metalserve.api.responses.store import ResponseStore, StoredResponse
from metalserve.api.settings import ServerSettings
from tests.api.conftest import MODEL, Served, live, make_served
from tests.api.fakes import DEFAULT_REPLY

CALL = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ONLY_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}]


@pytest.fixture(scope="module")
def client(server: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _post(server: Served, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body}, timeout=30)


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(ln[len("data: ") :]) for ln in response.text.splitlines() if ln.startswith("data: ")]


def test_text_response_and_retrieve(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=64)
    assert response.status == "completed" and response.output_text == DEFAULT_REPLY
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.usage is not None and response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    again = client.responses.retrieve(response.id)
    assert again.output_text == DEFAULT_REPLY and again.id == response.id
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_event_sequence_in_order(server: Served) -> None:
    events = _events(_post(server, input=f"say:{CALL}", tools=TOOLS, stream=True))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    names = [e["type"] for e in events]
    text_deltas = names.count("response.output_text.delta")
    arg_deltas = names.count("response.function_call_arguments.delta")
    assert text_deltas > 0 and arg_deltas > 0
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * text_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * arg_deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    done = events[-1]["response"]
    assert done["status"] == "completed" and [i["type"] for i in done["output"]] == ["message", "function_call"]
    call = done["output"][1]
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"].startswith("call_")
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args == call["arguments"]
    assert {e["output_index"] for e in events if e["type"] == "response.function_call_arguments.delta"} == {1}


def test_streamed_equals_non_streamed(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="Hi")
    with client.responses.stream(model=MODEL, input="Hi") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == whole.output_text == final.output_text
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens


def _round_trip(client: openai.OpenAI, stream: bool) -> None:
    if stream:
        with client.responses.stream(model=MODEL, input=f"say:{ONLY_CALL}", tools=TOOLS) as s:  # type: ignore[arg-type]
            first = s.get_final_response()
    else:
        first = client.responses.create(model=MODEL, input=f"say:{ONLY_CALL}", tools=TOOLS)  # type: ignore[arg-type]
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    # With the history resent by the client (no store) ...
    items = [
        {"role": "user", "content": f"say:{ONLY_CALL}"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "say:22 C and sunny"},
    ]
    second = client.responses.create(model=MODEL, input=items, tools=TOOLS, store=False)  # type: ignore[arg-type]
    assert second.output_text == "22 C and sunny"
    # ... and through previous_response_id.
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "say:Sunny"}
    third = client.responses.create(model=MODEL, previous_response_id=first.id, input=[output], tools=TOOLS)  # type: ignore[arg-type,list-item]
    assert third.output_text == "Sunny" and third.previous_response_id == first.id


def test_function_call_round_trip(client: openai.OpenAI) -> None:
    _round_trip(client, stream=False)


def test_function_call_round_trip_streamed(client: openai.OpenAI) -> None:
    _round_trip(client, stream=True)


def test_function_call_output_reaches_the_template(server: Served) -> None:
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "22 C"},
    ]
    assert _post(server, input=items, tools=TOOLS, max_output_tokens=3).status_code == 200
    prompt = server.engine.tokenizer.decode(server.core.added[-1].prompt_token_ids)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "tool\n22 C" in prompt


def test_a_messages_text_parts_reach_the_template_a_line_apart(server: Served) -> None:
    """As the chat API joins them (Codex sends its developer message as several parts)."""
    parts = [{"type": "input_text", "text": "</skills>"}, {"type": "input_text", "text": "<permissions>"}]
    items = [{"type": "message", "role": "developer", "content": parts}, {"role": "user", "content": "Hi"}]
    assert _post(server, input=items, max_output_tokens=3).status_code == 200
    prompt = server.engine.tokenizer.decode(server.core.added[-1].prompt_token_ids)
    assert "</skills>\n<permissions>" in prompt


def test_incomplete_and_sampling_fields(server: Served) -> None:
    body = _post(server, input="Hi", max_output_tokens=2, temperature=0.5, top_p=0.9, metadata={"k": "v"}).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {
        "reason": "max_output_tokens",
        "cause": "max_output_tokens",
    }
    assert body["metadata"] == {"k": "v"} and body["temperature"] == 0.5
    params = server.core.added[-1].sampling_params
    assert (params.temperature, params.top_p, params.max_tokens) == (0.5, 0.9, 2)
    events = _events(_post(server, input="Hi", max_output_tokens=2, stream=True))
    assert events[-1]["type"] == "response.incomplete"


def test_store_false_and_unknown_ids(server: Served) -> None:
    unstored = _post(server, input="Hi", store=False).json()
    missing = httpx.get(f"{server.url}/v1/responses/{unstored['id']}")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    follow = _post(server, input="Hi", previous_response_id=unstored["id"])
    assert follow.status_code == 400 and follow.json()["error"]["param"] == "previous_response_id"


ERRORS: list[tuple[str, dict[str, Any], int, str]] = [
    ("unknown call_id", {"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, 400, "nope"),
    (
        "unknown tool in tool_choice",
        {"input": "Hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
        400,
        "nope",
    ),
    (
        "image input",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
        400,
        "vision",
    ),
    ("non-function tool", {"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ("unknown field", {"input": "Hi", "bogus": 1}, 400, "bogus"),
    ("no input", {}, 400, "input"),
    ("unknown model", {"input": "Hi", "model": "gpt-nope"}, 404, "gpt-nope"),
    ("reasoning without a parser", {"input": "Hi", "reasoning": {"effort": "high"}}, 400, "reasoning"),
]


@pytest.mark.parametrize(("case", "body", "status", "needle"), ERRORS, ids=[c[0] for c in ERRORS])
def test_errors_in_openai_shape(server: Served, case: str, body: dict[str, Any], status: int, needle: str) -> None:
    response = _post(server, **body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"] + str(error["param"])
    assert _post(server, input="Hi", max_output_tokens=2).status_code == 200  # and the server goes on


def test_cached_input_grows_over_five_turns(client: openai.OpenAI) -> None:
    previous, cached = None, []
    for turn in range(5):
        text = "say:Paris is sunny today. " * 3 if turn == 0 else f"say:turn {turn} ok"
        response = client.responses.create(
            model=MODEL, input=text, instructions="You are terse.", previous_response_id=previous, max_output_tokens=16
        )  # type: ignore[arg-type]
        assert response.usage is not None
        cached.append(response.usage.input_tokens_details.cached_tokens)
        previous = response.id
    assert all(b > a for a, b in zip(cached, cached[1:], strict=False)), cached


def test_store_is_a_bounded_lru() -> None:
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"output": []}, []))
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", StoredResponse({"output": []}, []))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert len(ResponseStore(0)) == 0


@pytest.fixture(scope="module")
def thinking_server() -> Iterator[Served]:
    settings = ServerSettings(
        tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="deepseek_r1", log_stats_interval=0
    )
    with live(make_served(settings)) as served:
        yield served


def test_reasoning_items_streamed_and_not(thinking_server: Served) -> None:
    ask = "say:Paris is the capital.</think>Paris."
    body = _post(thinking_server, input=ask, reasoning={"effort": "low", "summary": "auto"}).json()
    [reasoning, message] = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "Paris is the capital."
    assert reasoning["summary"][0]["text"] == "Paris is the capital."
    assert message["content"][0]["text"] == "Paris."
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    events = _events(_post(thinking_server, input=ask, stream=True))
    names = [e["type"] for e in events]
    assert names.index("response.reasoning_text.done") < names.index("response.output_text.delta")
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == "Paris is the capital."
    # A reasoning item sent back is accepted (its text goes to the template as reasoning_content).
    again = _post(thinking_server, input=[*body["output"], {"role": "user", "content": "say:ok"}])
    assert again.status_code == 200, again.text


def test_bad_item_errors_name_the_item_field(server: Served) -> None:
    error = _post(server, input=[{"type": "function_call_output", "output": "x"}]).json()["error"]
    assert error["param"] == "input.0.function_call_output.call_id" and "required" in error["message"]
    error = _post(server, input=[{"type": "item_reference", "id": "x"}]).json()["error"]
    assert error["param"] == "input.0" and "item_reference" in error["message"]


@pytest.fixture(scope="module")
def big_server() -> Iterator[Served]:
    with live(make_served(max_model_len=1024)) as served:  # tools in the template make long prompts
        yield served


def test_what_codex_sends(big_server: Served) -> None:
    """Namespaced and deferred function tools, client_metadata, include, store false, reasoning.summary."""
    ASK = "say:" + ONLY_CALL.replace("get_weather", "spawn_agent")  # noqa: N806
    agents = {
        "type": "namespace",
        "name": "agents",
        "description": "Sub-agents.",
        "tools": [
            {"type": "function", "name": "spawn_agent", "description": "Start one.", "parameters": {"type": "object"}}
        ],
    }
    later = {"type": "function", "name": "later", "parameters": {"type": "object"}, "defer_loading": True}
    body = {
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be safe."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
        ],
        "tools": [*TOOLS, agents, later],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "store": False,
        "reasoning": {"summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "k",
        "client_metadata": {"session_id": "s"},
        "stream": True,
    }
    events = _events(_post(big_server, **body))
    prompt = big_server.engine.tokenizer.decode(big_server.core.added[-1].prompt_token_ids)
    assert "[agents] Sub-agents.: Start one." in prompt and "later" not in prompt
    assert prompt.startswith("<|im_start|>system\nTools:") and "system\nBe safe." in prompt
    [done] = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done["name"] == "spawn_agent" and done["namespace"] == "agents"
    # The call goes back as input with its namespace.
    output = {"type": "function_call_output", "call_id": done["call_id"], "output": "say:ok"}
    again = _post(big_server, **{**body, "stream": False, "input": [*body["input"], done, output]})
    assert again.status_code == 200 and again.json()["output"][0]["content"][0]["text"] == "ok"
    twice = {**body, "tools": [*TOOLS, {**agents, "tools": [{**agents["tools"][0], "name": "get_weather"}]}]}
    assert _post(big_server, **twice).status_code == 400
