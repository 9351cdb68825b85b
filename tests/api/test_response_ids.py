"""The id a client sees is its engine request id (the one the server logs and aborts by), in each API's shape,
through the real threaded server and the official SDKs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.api.conftest import MODEL, Served, live, make_served

SAY = [{"role": "user", "content": "say:hello there"}]


@pytest.fixture()
def served() -> Iterator[Served]:
    with live(make_served(step_delay=0.005)) as s:
        yield s


def _engine_ids(served: Served) -> list[str]:
    return [r.request_id for r in served.core.added]


def test_chat_and_completions_ids_are_the_engine_request_ids(served: Served) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=SAY, max_tokens=4)  # type: ignore[arg-type]
    assert chat.id.startswith("chatcmpl-") and _engine_ids(served) == [chat.id]
    chunks = list(client.chat.completions.create(model=MODEL, messages=SAY, max_tokens=4, stream=True))  # type: ignore[arg-type]
    assert {c.id for c in chunks} == {_engine_ids(served)[-1]}
    two = client.chat.completions.create(model=MODEL, messages=SAY, max_tokens=4, n=2)  # type: ignore[arg-type]
    assert _engine_ids(served)[-2:] == [f"{two.id}-0", f"{two.id}-1"]  # one engine request per sample
    served.core.added.clear()
    done = client.completions.create(model=MODEL, prompt="say:hi", max_tokens=4)
    assert done.id.startswith("cmpl-") and _engine_ids(served) == [done.id]
    both = client.completions.create(model=MODEL, prompt=["say:a", "say:b"], max_tokens=4)
    assert _engine_ids(served)[-2:] == [f"{both.id}-0", f"{both.id}-1"]  # one per prompt


def test_messages_and_responses_ids_are_the_engine_request_ids(served: Served) -> None:
    claude = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    message = claude.messages.create(model=MODEL, max_tokens=4, messages=SAY)  # type: ignore[arg-type]
    assert message.id.startswith("msg_") and _engine_ids(served) == [message.id]
    with claude.messages.stream(model=MODEL, max_tokens=4, messages=SAY) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_message()
    assert streamed.id == _engine_ids(served)[-1] != message.id
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    response = client.responses.create(model=MODEL, input="say:hello", max_output_tokens=4)
    assert response.id.startswith("resp_") and _engine_ids(served)[-1] == response.id
    assert client.responses.retrieve(response.id).id == response.id


def test_a_disconnect_aborts_the_request_by_the_id_the_client_saw(served: Served) -> None:
    body = {"messages": SAY, "stream": True, "ignore_eos": True, "max_tokens": 100}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
    seen = json.loads(first.removeprefix("data: "))["id"]
    deadline = time.monotonic() + 10
    while not served.core.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert served.core.aborted == [seen]
