"""Tools for a chat template that drops them (as SmolLM2's does): detected at start-up, described in the
system message in the generic form, counted by count_tokens, and calls read back in all three APIs
(fake core, real uvicorn server, the official SDKs)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from metalserve.api.generic_tools import TOOLS_FOOTER, template_renders_tools, with_generic_tools
from metalserve.api.settings import ServerSettings
from metalserve.engine.async_engine import AsyncEngine
from tests.api.conftest import MODEL, Served, app_of_engine, live
from tests.api.fakes import CHAT_TEMPLATE, FakeCore, say_reply, tiny_tokenizer

# A ChatML template that never looks at `tools` (SmolLM2's has the same shape).
NO_TOOLS_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK_CALL = [{"role": "user", "content": f"say:{CALL}"}]


def _served(generic: bool) -> Served:
    tok = tiny_tokenizer()
    core = FakeCore(tok, say_reply(tok))
    engine = AsyncEngine(
        core,
        tok,
        model_name=MODEL,
        max_model_len=core.max_model_len * 8,
        eos_token_ids={2},
        chat_template=NO_TOOLS_TEMPLATE,
    )
    core.max_model_len *= 8  # the tool list takes room
    settings = ServerSettings(
        tool_call_parser="hermes", enable_auto_tool_choice=True, log_stats_interval=0, generic_tool_prompt=generic
    )
    return Served(app_of_engine(engine, settings), core, engine)


@pytest.fixture(scope="module")
def generic() -> Iterator[Served]:
    with live(_served(True)) as served:
        yield served


def _prompt(served: Served) -> str:
    return str(served.engine.tokenizer.decode(served.core.added[-1].prompt_token_ids))


def test_detects_templates_that_drop_tools() -> None:
    tok = tiny_tokenizer()
    assert template_renders_tools(tok, CHAT_TEMPLATE)
    assert not template_renders_tools(tok, NO_TOOLS_TEMPLATE)


def test_history_becomes_text_in_the_generic_form() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"},
        {"role": "user", "content": "And now?"},
    ]
    out = with_generic_tools(history, [{"type": "function", "function": WEATHER}])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].endswith(TOOLS_FOOTER) and json.dumps(WEATHER) in out[0]["content"]
    assert out[2]["content"] == CALL
    assert out[3]["content"] == "<tool_response>\n22 C\n</tool_response>\nAnd now?"


def test_chat_call_read_back(generic: Served) -> None:
    client = openai.OpenAI(base_url=f"{generic.url}/v1", api_key="x", max_retries=0)
    tools: Any = [{"type": "function", "function": WEATHER}]
    made = client.chat.completions.create(model=MODEL, messages=ASK_CALL, tools=tools)  # type: ignore[arg-type]
    prompt = _prompt(generic)
    assert prompt.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in prompt
    choice = made.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    stream = client.chat.completions.create(model=MODEL, messages=ASK_CALL, tools=tools, stream=True)  # type: ignore[arg-type]
    names = [c.function.name for chunk in stream for c in chunk.choices[0].delta.tool_calls or [] if c.function]  # type: ignore[union-attr]
    assert "get_weather" in names


def test_messages_and_responses_calls_and_counts(generic: Served) -> None:
    claude = anthropic.Anthropic(base_url=generic.url, api_key="x", max_retries=0)
    tool: Any = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
    message = claude.messages.create(model=MODEL, max_tokens=64, messages=ASK_CALL, tools=[tool])  # type: ignore[arg-type]
    assert message.stop_reason == "tool_use"
    use = message.content[-1]
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    with_tools = claude.messages.count_tokens(model=MODEL, messages=ASK_CALL, tools=[tool]).input_tokens  # type: ignore[arg-type]
    without = claude.messages.count_tokens(model=MODEL, messages=ASK_CALL).input_tokens  # type: ignore[arg-type]
    assert with_tools > without + 50  # the tool list and the instructions are counted

    oai = openai.OpenAI(base_url=f"{generic.url}/v1", api_key="x", max_retries=0)
    tools: Any = [{"type": "function", **WEATHER}]
    made = oai.responses.create(model=MODEL, input=ASK_CALL[0]["content"], tools=tools, max_output_tokens=64)
    calls = [item for item in made.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    # The call and its result go back as text the template keeps.
    follow = [
        *ASK_CALL,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "22 C"}]},
    ]
    claude.messages.create(model=MODEL, max_tokens=4, messages=follow, tools=[tool])  # type: ignore[arg-type]
    prompt = _prompt(generic)
    assert '"arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n22 C\n</tool_response>" in prompt


def test_tool_choice_none_and_flag_off() -> None:
    with live(_served(False)) as off:
        body = {"model": MODEL, "messages": ASK_CALL, "tools": [{"type": "function", "function": WEATHER}]}
        httpx.post(f"{off.url}/v1/chat/completions", json=body)
        assert "# Tools" not in _prompt(off)
    with live(_served(True)) as on:
        httpx.post(f"{on.url}/v1/chat/completions", json={**body, "tool_choice": "none"})
        assert "# Tools" not in _prompt(on)
