"""--override-generation-config (vLLM's flag): sampling defaults for the fields a request leaves unset,
through every API; a field the request sets wins; a bad value is refused at start-up."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from metalserve.api.server import config_from_args
from metalserve.api.settings import ServerSettings
from metalserve.cli import build_parser, run_serve
from tests.api.conftest import MODEL, Served, live, make_served

DEFAULTS = '{"temperature": 0.25, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}'


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    settings = ServerSettings(
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        log_stats_interval=0,
        override_generation_config=(("temperature", 0.25), ("top_p", 0.8), ("top_k", 20), ("repetition_penalty", 1.05)),
    )
    with live(make_served(settings)) as served:
        yield served


def _params(server: Served) -> Any:
    return server.core.added[-1].sampling_params


def test_unset_fields_take_the_servers_defaults_in_every_api(server: Served) -> None:
    hi = [{"role": "user", "content": "Hi"}]
    httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": hi, "max_tokens": 2})
    chat = _params(server)
    assert (chat.temperature, chat.top_p, chat.top_k, chat.repetition_penalty) == (0.25, 0.8, 20, 1.05)
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    client.messages.create(model=MODEL, max_tokens=2, messages=hi)  # type: ignore[arg-type]
    assert _params(server).temperature == 0.25 and _params(server).top_k == 20
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    oai.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert _params(server).temperature == 0.25
    oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert _params(server).top_p == 0.8


def test_a_field_the_request_sets_wins(server: Served) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    httpx.post(f"{server.url}/v1/chat/completions", json={**body, "temperature": 0, "repetition_penalty": 1.0})
    params = _params(server)
    assert params.temperature == 0.0 and params.repetition_penalty == 1.0 and params.top_k == 20


def test_without_the_flag_the_apis_own_defaults() -> None:
    with live(make_served()) as served:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        httpx.post(f"{served.url}/v1/chat/completions", json=body)
        params = _params(served)
        assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (1.0, 1.0, 0, 1.0)


@pytest.mark.parametrize(
    ("value", "message"),
    [("[0.7]", "takes a JSON object"), ('{"temp": 0.7}', "'temp' is not one of"), ('{"top_k": "20"}', "a number")],
)
def test_a_bad_value_is_refused(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "m", "--override-generation-config", value])
    assert run_serve(args) == 1  # before any model is loaded
    assert message in capsys.readouterr().err


def test_the_flag_reaches_the_settings() -> None:
    args = build_parser().parse_args(["serve", "m", "--override-generation-config", DEFAULTS])
    _, settings = config_from_args(args)
    assert dict(settings.override_generation_config) == {
        "temperature": 0.25,
        "top_p": 0.8,
        "top_k": 20.0,
        "repetition_penalty": 1.05,
    }
