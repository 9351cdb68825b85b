"""The mistral, qwen3_coder, pythonic, deepseek_v3 and openai (harmony) parsers on literal model outputs,
whole and streamed in pieces of every size."""

from __future__ import annotations

import json

import pytest

from metalserve.api.tool_parsers import TOOL_PARSERS, get_tool_parser
from tests.api.test_tool_parsers import _names_args, _stream

CITY = {"city": "Paris"}
DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{}\n```<｜tool▁call▁end｜>"
CASES = [
    (
        "mistral",
        'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"tz": "CET"}}]</s>',
        "Sure.",
        [("get_weather", CITY), ("get_time", {"tz": "CET"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
        None,
        [("get_weather", CITY), ("get_time", {"tz": "CET"})],
    ),
    (
        "qwen3_coder",
        "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "I'll check.",
        [("get_weather", {"city": "Paris", "days": "3"})],
    ),
    (
        "pythonic",
        "[get_weather(city='Paris', metric=\"celsius\"), get_time(tz='UTC', dst=True, n=None)]",
        None,
        [("get_weather", {"city": "Paris", "metric": "celsius"}), ("get_time", {"tz": "UTC", "dst": True, "n": None})],
    ),
    ("pythonic", '<|python_start|>[get_weather(city="Paris")]<|python_end|>', None, [("get_weather", CITY)]),
    (
        "deepseek_v3",
        "Checking both.<｜tool▁calls▁begin｜>"
        + DS_CALL.replace("{}", '{"city": "Paris"}')
        + "\n"
        + DS_CALL.replace("{}", '{"city": "Tokyo"}')
        + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        "Checking both.",
        [("get_weather", CITY), ("get_weather", {"city": "Tokyo"})],
    ),
    (
        "deepseek_v3",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "UTC"}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>",
        None,
        [("get_time", {"tz": "UTC"})],
    ),
    (
        "openai",
        "<|channel|>analysis<|message|>User asks weather. Use the tool.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
        None,
        [("get_weather", CITY)],
    ),
    (
        "openai",
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}<|call|>',
        None,
        [("get_time", {"tz": "UTC"})],
    ),
]
PLAIN = {
    "mistral": "No tools needed: [1, 2] is a list.",
    "qwen3_coder": "Use <b>bold</b> text.",
    "pythonic": "[1] is a citation, not a call.",
    "deepseek_v3": "Just text.",
    "openai": "A plain reply without harmony markers.",
}


def test_names_are_registered_as_vllm_spells_them() -> None:
    assert {"mistral", "qwen3_coder", "pythonic", "deepseek_v3", "openai"} <= set(TOOL_PARSERS)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_whole_text(name: str, text: str, content: str | None, calls: list[tuple[str, object]]) -> None:
    got = get_tool_parser(name).extract(text)
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls
    assert len({c.id for c in got.calls}) == len(calls)


@pytest.mark.parametrize("size", [1, 2, 5, 11, 10_000])
@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_streamed_in_pieces(
    name: str, text: str, content: str | None, calls: list[tuple[str, object]], size: int
) -> None:
    streamed, got, _ = _stream(get_tool_parser(name), text, size)
    assert _names_args(got) == calls
    assert streamed.strip() == (content or "")


@pytest.mark.parametrize(("name", "text"), sorted(PLAIN.items()))
def test_plain_text_stays_content(name: str, text: str) -> None:
    got = get_tool_parser(name).extract(text)
    assert got.content == text and not got.calls
    for size in (1, 4, 100):
        assert _stream(get_tool_parser(name), text, size)[:2] == (text, [])
    for size in (1, 4, 100):
        streamed, calls, _ = _stream(get_tool_parser(name), text, size)
        assert streamed == text and not calls


@pytest.mark.parametrize(("name", "eos"), [("mistral", "</s>"), ("deepseek_v3", "<｜end▁of▁sentence｜>")])
def test_the_end_of_sequence_text_is_not_content(name: str, eos: str) -> None:
    assert get_tool_parser(name).extract(f"Hello there.{eos}").content == "Hello there."
    for size in (1, 3, 50):
        assert _stream(get_tool_parser(name), f"Hello there.{eos}", size)[0] == "Hello there."


def test_qwen3_coder_types_parameters_by_the_tool_schema() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "days": {"type": "integer"},
                        "metric": {"type": "boolean"},
                        "zip": {"type": "string"},
                        "opts": {"type": "object"},
                    },
                },
            },
        }
    ]
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n"
        '<parameter=opts>\n{"a": [1]}\n</parameter>\n</function>\n</tool_call>'
    )
    (call,) = get_tool_parser("qwen3_coder").for_request(tools).extract(text).calls
    assert json.loads(call.arguments) == {
        "city": "Paris",
        "days": 3,
        "metric": True,
        "zip": "75001",
        "opts": {"a": [1]},
    }


def test_harmony_final_channel_is_the_content_and_analysis_is_not() -> None:
    text = (
        "<|channel|>analysis<|message|>Simple question.<|end|><|start|>assistant<|channel|>final<|message|>"
        "The capital is Paris.<|return|>"
    )
    got = get_tool_parser("openai").extract(text)
    assert got.content == "The capital is Paris." and not got.calls
    streamed, calls, _ = _stream(get_tool_parser("openai"), text, 3)
    assert streamed == "The capital is Paris." and not calls


def test_markers_that_are_special_tokens_are_kept_when_detokenizing() -> None:
    keeps = {name for name, cls in TOOL_PARSERS.items() if cls.keeps_special_tokens}
    assert keeps == {"mistral", "deepseek_v3", "openai"}


def test_a_special_token_format_turns_skip_special_tokens_off() -> None:
    import httpx

    from metalserve.api.settings import ServerSettings
    from tests.api.conftest import MODEL, live, make_served

    settings = ServerSettings(tool_call_parser="mistral", enable_auto_tool_choice=True, log_stats_interval=0)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with live(make_served(settings, max_model_len=1024)) as served:
        url = f"{served.url}/v1/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "say:hi"}]}
        assert httpx.post(url, json={**body, "tools": tools}).is_success
        assert served.core.added[-1].sampling_params.skip_special_tokens is False
        assert httpx.post(url, json=body).is_success  # no tools: no parsing, the default stays
        assert served.core.added[-1].sampling_params.skip_special_tokens is True


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("mistral", "[TOOL_CALLS] not json"),
        ("deepseek_v3", "<｜tool▁calls▁begin｜>garbage"),
        ("qwen3_coder", "<tool_call>\n<function=f>\nunclosed"),
    ],
)
def test_a_broken_call_gives_the_text_back(name: str, text: str) -> None:
    got = get_tool_parser(name).extract(text)
    assert got.content == text and not got.calls
    for size in (1, 4, 100):
        assert _stream(get_tool_parser(name), text, size)[:2] == (text, [])
