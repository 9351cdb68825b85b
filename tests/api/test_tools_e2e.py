"""Tool calling through the real HTTP path: the fake engine emits a hermes call text token by token."""

from __future__ import annotations

import json

import httpx
import openai

from tests.api.conftest import MODEL, Served

CALL = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": f"say:{CALL}"}]


def test_non_streamed_tool_call(server: Served) -> None:
    body = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, "tools": TOOLS}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_tool_choice_none_leaves_text(server: Served) -> None:
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "none"}
    choice = httpx.post(f"{server.url}/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "<tool_call>" in choice["message"]["content"]


def test_sdk_stream_helper_assembles_the_call(server: Served) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS) as stream:  # type: ignore[arg-type]
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]


def test_tool_result_goes_back_through_the_template(server: Served) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"},
    ]
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    prompt = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "tool\n22 C and sunny" in prompt
    body = {"messages": messages, "tools": TOOLS}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body).json()["choices"][0]
    assert reply["finish_reason"] == "stop" and reply["message"]["content"]
