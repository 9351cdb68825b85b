"""Reasoning parsers: whole and character-by-character streaming agree; chat shows reasoning_content."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from metalserve.api.reasoning import ReasoningDelta, get_reasoning_parser
from metalserve.api.settings import ServerSettings
from tests.api.conftest import MODEL, Served, live, make_served

HARMONY = (
    "<|channel|>analysis<|message|>User wants the capital.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Paris.<|return|>"
)
# (parser, prompt tail, output, reasoning, answer)
CASES = [
    ("qwen3", "", "<think>\nhmm</think>\n\nAnswer", "\nhmm", "Answer"),
    ("qwen3", "", "No thinking here </think> really", "", "No thinking here </think> really"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "hmm</think>ok", "hmm", "ok"),
    ("qwen3", "", "  <thi", "", "  <thi"),
    ("deepseek_r1", "", "hmm</think>\nok", "hmm", "ok"),
    ("deepseek_r1", "", "<think>hmm</think>ok", "hmm", "ok"),
    ("deepseek_r1", "", "cut off while thinking", "cut off while thinking", ""),
    ("gpt_oss", "", HARMONY, "User wants the capital.", "Paris."),
    ("gpt_oss", "", "plain answer", "", "plain answer"),
    (
        "gpt_oss",
        "",
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>",
        "",
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>",
    ),
]


@pytest.mark.parametrize(("name", "tail", "text", "reasoning", "answer"), CASES)
def test_split_whole_and_streamed(name: str, tail: str, text: str, reasoning: str, answer: str) -> None:
    parser = get_reasoning_parser(name)
    assert parser.split(text, tail) == ReasoningDelta(reasoning, answer)
    streamer = parser.streaming(tail)
    pieces = [streamer.feed(ch) for ch in text] + [streamer.finish()]
    assert "".join(p.reasoning for p in pieces) == reasoning
    assert "".join(p.content for p in pieces) == answer


def test_unknown_parser_names_the_choices() -> None:
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")


@pytest.fixture(scope="module")
def qwen3_server() -> Iterator[Served]:
    settings = ServerSettings(
        tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3", log_stats_interval=0
    )
    with live(make_served(settings)) as served:
        yield served


def _chat(server: Served, content: str, **body: Any) -> httpx.Response:
    messages = [{"role": "user", "content": content}]
    return httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, **body})


def test_chat_reasoning_content_streamed_and_not(qwen3_server: Served) -> None:
    ask = "say:<think>Paris is the capital.</think>\n\nParis."
    message = _chat(qwen3_server, ask).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "reasoning_content": "Paris is the capital.", "content": "Paris."}
    lines = _chat(qwen3_server, ask, stream=True).text.splitlines()
    chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Paris is the capital."
    assert "".join(d.get("content", "") for d in deltas) == "Paris."


def test_reasoning_then_tool_call(qwen3_server: Served) -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    choice = _chat(qwen3_server, f"say:<think>Need weather.</think>{call}", tools=tools).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "Need weather."
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_parallel_tool_calls_false_keeps_the_first(server: Served) -> None:
    calls = "".join(f'<tool_call>{{"name": "f{i}", "arguments": {{}}}}</tool_call>' for i in range(2))
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(2)]
    for parallel, names in ((True, ["f0", "f1"]), (False, ["f0"])):
        body = {"tools": tools, "parallel_tool_calls": parallel}
        message = _chat(server, f"say:{calls}", **body).json()["choices"][0]["message"]
        assert [c["function"]["name"] for c in message["tool_calls"]] == names
        lines = _chat(server, f"say:{calls}", stream=True, **body).text.splitlines()
        chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        streamed = [
            t["function"]["name"] for c in chunks for t in c["choices"][0]["delta"].get("tool_calls", []) if "id" in t
        ]
        assert streamed == names


def test_grammar_waits_for_the_end_of_reasoning() -> None:
    from metalserve.api.reasoning import gate_on_reasoning
    from metalserve.sampling_params import SamplingParams
    from metalserve.structured.params import StructuredOutputsParams
    from tests.api.fakes import tiny_tokenizer

    tok = tiny_tokenizer()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    gate_on_reasoning(params, get_reasoning_parser("qwen3"), tok)
    assert params.structured_outputs is not None
    ids = params.structured_outputs.reasoning_end_token_ids
    assert ids and tok.decode(list(ids)) == "</think>" and params.structured_outputs.json_object
    plain = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    gate_on_reasoning(plain, None, tok)
    assert plain.structured_outputs is not None and plain.structured_outputs.reasoning_end_token_ids == ()


def test_harmony_reasoning_leaves_calls_to_the_openai_tool_parser() -> None:
    from metalserve.api.deltas import OutputParsing
    from metalserve.api.tool_parsers import get_tool_parser

    text = (
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    )
    parsing = OutputParsing(reasoning=get_reasoning_parser("gpt_oss"), tools=get_tool_parser("openai"))
    final = parsing.final(text, "stop")
    assert final.reasoning == "Need weather." and final.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in final.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    streamer = parsing.streamer(0)
    from metalserve.engine.async_engine import RequestOutput

    deltas = [
        streamer.feed(RequestOutput("r", ch, [], None, "stop" if i == len(text) - 1 else None, None, 5, 0, i + 1))
        for i, ch in enumerate(text)
    ]
    assert "".join(d.reasoning for d in deltas) == "Need weather."
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0].name == "get_weather" and "".join(c.arguments for c in calls) == '{"city": "Paris"}'
    assert deltas[-1].finish_reason == "tool_calls"


def test_structured_requests_are_gated_on_the_reasoning_end(qwen3_server: Served) -> None:
    ask = [{"role": "user", "content": 'say:<think>hm</think>{"a": 1}'}]
    chat = {"model": MODEL, "messages": ask, "response_format": {"type": "json_object"}}
    messages = {
        "model": MODEL,
        "max_tokens": 32,
        "messages": ask,
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
    }
    for route, body in (("chat/completions", chat), ("messages", messages)):
        response = httpx.post(f"{qwen3_server.url}/v1/{route}", json=body, timeout=30)
        assert response.status_code == 200, response.text
        spec = qwen3_server.core.added[-1].sampling_params.structured_outputs
        assert spec is not None
        assert qwen3_server.engine.tokenizer.decode(list(spec.reasoning_end_token_ids)) == "</think>"
