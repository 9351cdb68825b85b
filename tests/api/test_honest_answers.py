"""Issue 28's wrong answers, each as a regression test through the threaded HTTP server (fake core: it
replies with what follows `say:` in the prompt, so the model's output is forced).

Grammars that are empty, too complex or too large are 400s with a one-line reason; tool calls come
out the same streamed and not (unclosed and unknown calls are content); a forced Anthropic call cut by
max_tokens is a tool_use block with stop_reason max_tokens; Responses metadata and the store are bounded.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from metalserve.api.settings import ServerSettings
from metalserve.structured.limits import GrammarLimits
from tests.api.conftest import MODEL, Served, live, make_served

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CYCLIC = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    settings = ServerSettings(
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        log_stats_interval=0,
        responses_store_bytes=20_000,
        grammar=GrammarLimits(grammar_compile_timeout=8.0),
    )
    with live(make_served(settings, max_model_len=2048)) as served:
        yield served


def say(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"say:{text}"}]


def post(server: Served, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json={"model": MODEL, **body}, timeout=60)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"regex": "a{1000000}"}, "too complex"),
        ({"regex": "((a{100}){100}){100}"}, "too complex"),
        ({"json": CYCLIC}, "matches no text"),
        ({"grammar": 'start: a\na: a "x"'}, "matches no text"),
        ({"choice": [f"option{i}" for i in range(100_000)]}, "--max-grammar-bytes"),
    ],
    ids=["a{1000000}", "nested-repeat", "cyclic-ref", "empty-lark", "choice-100k"],
)
def test_unusable_grammars_are_short_400s_before_admission(server: Served, spec: dict[str, Any], words: str) -> None:
    before = len(server.core.added)
    response = post(server, "chat/completions", {"messages": say("x"), "max_tokens": 16, "structured_outputs": spec})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"].startswith("structured_outputs.")
    for leak in ("panic", "backtrace", "<state>", "\n"):
        assert leak not in error["message"]
    assert len(error["message"]) < 400
    assert len(server.core.added) == before  # never admitted


def test_a_grammar_past_the_compile_time_limit_is_a_400(server: Served) -> None:
    engine = server.engine
    limits = engine.grammar.limits
    engine.grammar.limits = dataclasses.replace(limits, grammar_compile_timeout=0.05)
    try:
        body = {"messages": say("x"), "structured_outputs": {"regex": "((b{90}){90}){90}"}}
        response = post(server, "chat/completions", body)
    finally:
        engine.grammar.limits = limits
    assert response.status_code == 400 and "did not compile within 0.05 s" in response.json()["error"]["message"]


UNCLOSED = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
AROUND = 'text before <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> text after'
UNKNOWN = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
SURROGATE = '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud800"}}</tool_call>'


def _chat(server: Served, reply: str, stream: bool) -> tuple[str | None, list[tuple[str, Any]], str | None]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    kwargs: Any = {"model": MODEL, "messages": say(reply), "tools": TOOLS, "max_tokens": 200}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]  # type: ignore[union-attr]
        return choice.message.content or None, calls, choice.finish_reason
    with client.chat.completions.stream(**kwargs) as events:
        for _ in events:
            pass
        final = events.get_final_completion().choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls or []]  # type: ignore[union-attr]
    return final.message.content or None, calls, final.finish_reason  # the SDK sums a stream's "" deltas


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (UNCLOSED, (UNCLOSED, [], "stop")),
        (AROUND, ("text before text after", [("get_weather", {"city": "Paris"})], "tool_calls")),
        (UNKNOWN, (UNKNOWN, [], "stop")),
        (SURROGATE, (SURROGATE, [], "stop")),
    ],
    ids=["unclosed", "text-around", "unknown-tool", "lone-surrogate"],
)
def test_hermes_answers_agree_streamed_and_not(server: Served, reply: str, expected: tuple[Any, ...]) -> None:
    whole = _chat(server, reply, stream=False)
    streamed = _chat(server, reply, stream=True)
    assert whole == streamed
    content, calls, reason = whole
    assert (content, calls, reason) == expected


ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_anthropic_call_cut_by_max_tokens_is_a_tool_use_block(server: Served, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused")
    kwargs: Any = {
        "model": MODEL,
        "max_tokens": 6,
        "messages": say('{"city": "Paris", "days": 3}'),
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert message.stop_reason == "max_tokens"
    assert [block.type for block in message.content] == ["tool_use"]
    block = message.content[0]
    assert block.name == "get_weather" and isinstance(block.input, dict)  # type: ignore[union-attr]
    assert set(block.input) <= {"city", "days"}  # type: ignore[union-attr]


def test_a_forced_openai_call_cut_by_max_tokens_says_length_streamed_and_not(server: Served) -> None:
    body = {
        "messages": say('{"city": "Paris", "days": 3}'),
        "tools": TOOLS,
        "max_tokens": 6,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    whole = post(server, "chat/completions", body).json()["choices"][0]
    assert whole["finish_reason"] == "length"
    (call,) = whole["message"]["tool_calls"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    arguments, reason = "", None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **body):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            arguments += delta_call.function.arguments or ""  # type: ignore[union-attr]
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "length" and arguments == call["function"]["arguments"]


@pytest.mark.parametrize(
    ("metadata", "words"),
    [
        ({f"k{i}": "v" for i in range(17)}, "at most 16"),
        ({"k" * 65: "v"}, "at most 64"),
        ({"k": "v" * 513}, "at most 512"),
    ],
)
def test_responses_metadata_is_limited_as_openai_limits_it(
    server: Served, metadata: dict[str, str], words: str
) -> None:
    response = post(server, "responses", {"input": "say:hi", "metadata": metadata})
    assert response.status_code == 400
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == "metadata" and error["type"] == "invalid_request_error"
    ok = post(server, "responses", {"input": "say:hi", "metadata": {"k" * 64: "v" * 512}})
    assert ok.status_code == 200 and ok.json()["metadata"] == {"k" * 64: "v" * 512}


def test_the_responses_store_stays_within_its_bytes(server: Served) -> None:
    ids = []
    for i in range(12):
        body = {"input": "say:" + "x" * 300, "metadata": {f"k{j}": str(i % 10) * 500 for j in range(4)}}
        ids.append(post(server, "responses", body).json()["id"])
    store = server.app.state.responses_store
    assert 0 < store.num_bytes <= 20_000 and len(store) < 12
    assert httpx.get(f"{server.url}/v1/responses/{ids[-1]}").status_code == 200
    assert httpx.get(f"{server.url}/v1/responses/{ids[0]}").status_code == 404


def test_memory_is_reported_by_component(server: Served) -> None:
    report = httpx.get(f"{server.url}/debug/memory").json()
    assert set(report) == {"weights", "kv_pool", "grammar_cache", "responses_store", "mlx_cache", "other", "rss"}
    assert report["responses_store"] == server.app.state.responses_store.num_bytes
    assert report["grammar_cache"] == server.engine.grammar.cache_bytes
    assert report["rss"] > 0 and report["rss"] >= sum(v for k, v in report.items() if k != "rss")


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_responses_call_cut_short_is_an_incomplete_function_call(server: Served, stream: bool) -> None:
    body = {
        "input": 'say:{"city": "Paris", "days": 3}',
        "max_output_tokens": 6,
        "stream": stream,
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }
    response = post(server, "responses", body)
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
        final = next(e["response"] for e in events if e["type"] == "response.incomplete")
    else:
        final = response.json()
    assert final["status"] == "incomplete"
    (item,) = final["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["status"] == "incomplete"


def test_a_grammar_failure_after_admission_is_an_error_not_an_answer() -> None:
    from metalserve.api.serving_common import engine_error
    from metalserve.engine.errors import GrammarFailedError

    error = engine_error(GrammarFailedError("the output could not follow its grammar: lexer error"))
    assert error.status == 500 and "could not follow its grammar" in error.message
