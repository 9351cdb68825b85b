"""`metalserve serve --models FILE` as users run it (a subprocess), with real random-weight models: each
request reaches the model it names, models load on first use on their own engine thread, and an idle
one unloads; the slow test serves the embedded default model beside a tiny one."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server import RunningServer, running_server
from tests.loader.tiny_models import write_mlx_dir

HI = [{"role": "user", "content": "Hello there"}]


def states(server: RunningServer) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(f"{server.v1}/models", timeout=30).json()["data"]}


def greedy(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(model=model, messages=HI, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert reply.model != model or reply.usage is not None
    return reply.choices[0].message.content or ""


@pytest.fixture(scope="module")
def two_tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("multi")
    models = [
        {"model": str(write_mlx_dir(root / "llama", "llama")), "name": "tiny-llama", "aliases": ["haiku"]},
        {"model": str(write_mlx_dir(root / "qwen3", "qwen3")), "name": "tiny-qwen", "max_model_len": 128},
    ]
    (root / "models.json").write_text(json.dumps(models))
    flags = ["--models", str(root / "models.json"), "--model-idle-timeout", "3", "--max-num-batched-tokens", "64"]
    with running_server(*flags, startup_timeout=120) as server:
        yield server


def test_each_request_reaches_the_model_it_names(two_tiny: RunningServer) -> None:
    assert states(two_tiny) == {"tiny-llama": "unloaded", "tiny-qwen": "unloaded"}
    client = openai.OpenAI(base_url=two_tiny.v1, api_key="x", max_retries=0)
    llama = greedy(client, "tiny-llama")
    assert states(two_tiny)["tiny-llama"] == "loaded" and states(two_tiny)["tiny-qwen"] == "unloaded"
    assert greedy(client, "haiku") == llama  # the alias is the same model, greedy is deterministic
    qwen = greedy(client, "tiny-qwen")
    assert qwen != llama  # another model's weights
    cards = {m["id"]: m for m in httpx.get(f"{two_tiny.v1}/models", timeout=30).json()["data"]}
    assert cards["tiny-qwen"]["max_model_len"] == 128 and cards["tiny-llama"]["aliases"] == ["haiku"]
    claude = httpx.post(
        f"{two_tiny.base_url}/v1/messages",
        timeout=60,
        json={"model": "haiku", "max_tokens": 8, "messages": HI, "temperature": 0},
    )
    assert claude.status_code == 200 and claude.json()["content"][0]["text"] == llama
    metrics = httpx.get(f"{two_tiny.base_url}/metrics", timeout=30).text
    for name in ("tiny-llama", "tiny-qwen"):
        series = f'vllm:generation_tokens_total{{model_name="{name}"}} '
        line = next(x for x in metrics.splitlines() if x.startswith(series))
        assert float(line.rsplit(" ", 1)[1]) > 0


def test_an_idle_model_unloads_and_loads_again(two_tiny: RunningServer) -> None:
    client = openai.OpenAI(base_url=two_tiny.v1, api_key="x", max_retries=0)
    before = greedy(client, "tiny-llama")
    deadline = time.monotonic() + 30
    while states(two_tiny)["tiny-llama"] != "unloaded":
        assert time.monotonic() < deadline, "the idle model was not unloaded"
        time.sleep(0.5)
    assert greedy(client, "tiny-llama") == before
    loads = {m["id"]: m["loads"] for m in httpx.get(f"{two_tiny.v1}/server/status", timeout=30).json()["models"]}
    assert loads["tiny-llama"] >= 2


@pytest.mark.slow
def test_default_model_beside_a_tiny_one_within_a_budget(tmp_path: Path) -> None:
    """The budget fits the default model alone: asking the tiny one unloads it (it is idle), and back."""
    tiny = write_mlx_dir(tmp_path / "tiny", "llama")
    smollm2 = {"name": "smollm2", "kv_cache_memory": 128 * 2**20, "max_model_len": 1024}
    models = [smollm2, {"model": str(tiny), "name": "tiny"}]
    (tmp_path / "models.yaml").write_text(json.dumps(models))
    flags = ["--models", str(tmp_path / "models.yaml"), "--model-idle-timeout", "0"]
    with running_server(*flags) as server:
        client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
        assert "Paris" in (
            client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=16,
                temperature=0,
            )
            .choices[0]
            .message.content
            or ""
        )
        status = httpx.get(f"{server.v1}/server/status", timeout=30).json()
        default_bytes = status["models"][0]["memory_bytes"]
    budget = default_bytes + 2**20  # the default model fits; the tiny one beside it does not
    with running_server(*flags, "--memory-budget", str(budget)) as server:
        client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
        greedy(client, "smollm2")
        greedy(client, "tiny")
        assert states(server) == {"smollm2": "unloaded", "tiny": "loaded"}
        greedy(client, "smollm2")
        assert states(server) == {"smollm2": "loaded", "tiny": "unloaded"}
