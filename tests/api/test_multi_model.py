"""Several models behind one real uvicorn server (fake cores, each built on its own engine thread):
routing by name and alias in the three APIs, load on first use, LRU unloads within a memory budget,
pinned models, requests in flight, the 503 when nothing can make room, and per-model metrics."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.api.multi_fakes import MB, FakeModels, make_registry, serving, spec

HI = [{"role": "user", "content": "Hi"}]
TWO = [spec("alpha", "a", "claude-haiku"), spec("beta", "b")]


def models(url: str) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def chat(url: str, model: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": HI, **extra}, timeout=30)


def wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_routing_by_name_and_alias_in_three_apis() -> None:
    fakes = FakeModels({"alpha": MB, "beta": MB})
    with serving(make_registry(fakes, TWO, budget=None)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="a", messages=HI)  # type: ignore[arg-type]
        assert reply.choices[0].message.content == "I am alpha." and reply.model == "alpha"
        completion = client.completions.create(model="beta", prompt="Hi", max_tokens=16)
        assert completion.choices[0].text == "I am beta." and completion.model == "beta"
        response = client.responses.create(model="claude-haiku", input="Hi")
        assert response.output_text == "I am alpha." and response.model == "alpha"
        claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        message = claude.messages.create(model="b", max_tokens=32, messages=HI)  # type: ignore[arg-type]
        assert message.content[0].text == "I am beta." and message.model == "beta"  # type: ignore[union-attr]
        cards = models(url)
        assert cards["alpha"]["aliases"] == ["a", "claude-haiku"] and cards["beta"]["aliases"] == ["b"]
        assert {c["state"] for c in cards.values()} == {"loaded"} and cards["alpha"]["max_model_len"] == 256
        assert sum(fakes.loads.values()) == 2  # one load each, whatever the name used


def test_unknown_model_is_a_404_in_each_api_shape() -> None:
    fakes = FakeModels({"alpha": MB, "beta": MB})
    with serving(make_registry(fakes, TWO, budget=None)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError) as chat_error:
            client.chat.completions.create(model="gamma", messages=HI)  # type: ignore[arg-type]
        message = chat_error.value.body["message"]  # type: ignore[index]
        assert "gamma" in message and "alpha, a, claude-haiku, beta, b" in message
        assert chat_error.value.body["code"] == "model_not_found"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="gamma", input="Hi")
        claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.NotFoundError) as claude_error:
            claude.messages.create(model="gamma", max_tokens=8, messages=HI)  # type: ignore[arg-type]
        body = claude_error.value.body
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"  # type: ignore[index]
        assert "alpha" in body["error"]["message"]  # type: ignore[index]
        assert not fakes.loads  # nothing was loaded for an unknown name


def test_first_use_loads_once_for_concurrent_requests_on_the_engine_thread() -> None:
    fakes = FakeModels({"alpha": MB, "beta": MB}, gates={"alpha": threading.Event()})
    with serving(make_registry(fakes, TWO, budget=None)) as url:
        assert models(url)["alpha"]["state"] == "unloaded"
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(chat, url, name) for name in ("alpha", "a", "claude-haiku", "alpha")]
            wait_for(lambda: models(url)["alpha"]["state"] == "loading")
            time.sleep(0.2)  # every request is now waiting for the one load
            assert not any(a.done() for a in answers)
            fakes.gates["alpha"].set()
            replies = [a.result(timeout=30) for a in answers]
        assert [r.json()["choices"][0]["message"]["content"] for r in replies] == ["I am alpha."] * 4
        assert fakes.loads["alpha"] == 1 and models(url)["alpha"]["state"] == "loaded"
        # The thread that loaded the model is the only one that ever touched its core.
        assert fakes.cores["alpha"].threads == {fakes.load_threads["alpha"]}


def test_lru_unload_under_a_budget_for_one_model_and_reload() -> None:
    fakes = FakeModels({"alpha": 100 * MB, "beta": 100 * MB})
    with serving(make_registry(fakes, TWO, budget=150 * MB)) as url:
        assert chat(url, "alpha").status_code == 200
        assert chat(url, "beta").json()["choices"][0]["message"]["content"] == "I am beta."
        cards = models(url)
        assert cards["alpha"]["state"] == "unloaded" and cards["beta"]["state"] == "loaded"
        # alpha's arrays were let go on the thread that made them
        assert fakes.release_threads["alpha"] == fakes.load_threads["alpha"]
        assert chat(url, "a").json()["choices"][0]["message"]["content"] == "I am alpha."
        assert fakes.loads == {"alpha": 2, "beta": 1}
        assert models(url)["beta"]["state"] == "unloaded"


def test_least_recently_used_goes_first() -> None:
    three = [*TWO, spec("gamma")]
    fakes = FakeModels({"alpha": 100 * MB, "beta": 100 * MB, "gamma": 100 * MB})
    with serving(make_registry(fakes, three, budget=250 * MB)) as url:
        for name in ("alpha", "beta", "alpha", "gamma"):  # beta is the least recently used at gamma's load
            assert chat(url, name).status_code == 200
        states = {k: v["state"] for k, v in models(url).items()}
        assert states == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}


def test_pinned_model_is_loaded_at_start_and_never_unloaded() -> None:
    specs = [spec("alpha", "a", pinned=True), spec("beta", "b")]
    fakes = FakeModels({"alpha": 100 * MB, "beta": 100 * MB})
    with serving(make_registry(fakes, specs, budget=150 * MB, idle_timeout=0.1)) as url:
        assert models(url)["alpha"]["state"] == "loaded" and fakes.loads["alpha"] == 1
        refused = chat(url, "beta")
        assert refused.status_code == 503
        error = refused.json()["error"]["message"]
        assert "cannot load the model `beta`" in error and "alpha (100.0 MiB, pinned)" in error
        time.sleep(0.5)  # several idle periods
        assert models(url)["alpha"]["state"] == "loaded" and fakes.loads["alpha"] == 1


def test_nothing_can_make_room_is_a_503_in_each_shape() -> None:
    fakes = FakeModels({"alpha": 100 * MB, "beta": 300 * MB})
    with serving(make_registry(fakes, TWO, budget=150 * MB)) as url:
        too_big = chat(url, "beta")
        assert too_big.status_code == 503 and "more than the whole budget" in too_big.json()["error"]["message"]
        claude = httpx.post(f"{url}/v1/messages", json={"model": "b", "max_tokens": 8, "messages": HI}, timeout=30)
        assert claude.status_code == 503 and claude.json()["type"] == "error"
        assert not fakes.loads["beta"]  # refused before loading anything


def test_a_request_in_flight_is_never_cut_by_an_unload() -> None:
    fakes = FakeModels({"alpha": 100 * MB, "beta": 100 * MB}, step_delay=0.02)
    with serving(make_registry(fakes, TWO, budget=150 * MB)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model="alpha",
            messages=HI,
            stream=True,
            max_tokens=40,
            extra_body={"ignore_eos": True},  # type: ignore[arg-type]
        )
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            other = pool.submit(chat, url, "beta")  # needs alpha's room
            text, reasons = "", []
            for chunk in stream:
                text += chunk.choices[0].delta.content or ""
                reasons.append(chunk.choices[0].finish_reason)
            alpha_done = time.monotonic()
            beta = other.result(timeout=30)
        assert reasons[-1] == "length" and text.startswith("I am alpha.")  # all 40 tokens, not cut
        assert beta.status_code == 200 and fakes.loads["beta"] == 1
        assert fakes.cores["alpha"].aborted == []
        assert alpha_done > 0 and models(url)["alpha"]["state"] == "unloaded"


def test_idle_timeout_unloads_and_the_next_request_loads_again() -> None:
    fakes = FakeModels({"alpha": MB, "beta": MB})
    with serving(make_registry(fakes, TWO, budget=None, idle_timeout=0.2)) as url:
        assert chat(url, "alpha").status_code == 200
        wait_for(lambda: models(url)["alpha"]["state"] == "unloaded")
        assert chat(url, "alpha").status_code == 200 and fakes.loads["alpha"] == 2


def test_every_metrics_series_carries_its_model_name() -> None:
    fakes = FakeModels({"alpha": MB, "beta": 2 * MB})
    with serving(make_registry(fakes, TWO, budget=None)) as url:
        chat(url, "alpha")
        chat(url, "b")
        text = httpx.get(f"{url}/metrics", timeout=10).text
        samples = [line for line in text.splitlines() if line.startswith(("vllm:", "metalserve:"))]
        assert samples and all('model_name="' in line for line in samples)
        for name in ("alpha", "beta"):
            gen = [s for s in samples if s.startswith(f'vllm:generation_tokens_total{{model_name="{name}"}}')]
            assert gen and float(gen[0].rsplit(" ", 1)[1]) > 0
        assert value(samples, 'metalserve:model_memory_bytes{model_name="beta"}') == 2 * MB
        assert value(samples, 'metalserve:model_loaded{model_name="alpha"}') == 1


def value(samples: list[str], series: str) -> float:
    return float(next(s for s in samples if s.startswith(series + " ")).rsplit(" ", 1)[1])
