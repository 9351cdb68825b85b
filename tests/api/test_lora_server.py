"""LoRA adapters through the real threaded server and the official SDKs: an adapter's name is served like
a model in every API, its answers are the fused model's, the base model's stay the base model's, and
/v1/models lists the adapters with their parent, as vLLM does."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from mlx.utils import tree_unflatten
from mlx_lm.tuner.utils import load_adapters
from mlx_lm.utils import load_model
from transformers import AutoTokenizer

from metalserve.api.settings import ServerSettings
from metalserve.config import EngineConfig
from tests.api.conftest import Served, live, serve_config
from tests.distributed.tiny_dir import write_tiny_dir
from tests.executor.test_runner_golden import mlx_lm_greedy
from tests.lora.tiny_adapters import make_mlx_lm_adapter

PROMPT = [5, 17, 33, 8, 21, 40, 12]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "model": write_tiny_dir(root / "tiny-base"),
        "sql": make_mlx_lm_adapter(root / "sql", seed=1, rank=4, scale=4.0, num_hidden_layers=4),
        "chat": make_mlx_lm_adapter(root / "chat", seed=2, rank=8, scale=4.0, num_hidden_layers=4),
    }


@pytest.fixture(scope="module")
def server(dirs: dict[str, Path]) -> Iterator[Served]:
    modules = (("sql", str(dirs["sql"])), ("chat", str(dirs["chat"])))
    config = EngineConfig(model=str(dirs["model"]), kv_cache_memory=1 << 24, enable_lora=True, lora_modules=modules)
    with live(serve_config(config, ServerSettings(log_stats_interval=0))) as served:
        yield served


def expected_text(dirs: dict[str, Path], adapter: str | None) -> str:
    """mlx-lm's greedy text from the model with the adapter fused into its weights (or the base model)."""
    model, _ = load_model(dirs["model"])
    if adapter is not None:
        load_adapters(model, str(dirs[adapter]))
        fused = [(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]
        model.update_modules(tree_unflatten(fused))
    tokens = mlx_lm_greedy(model, PROMPT, MAX_TOKENS)
    return str(AutoTokenizer.from_pretrained(dirs["model"]).decode(tokens))


def test_models_lists_the_adapters_with_their_parent(server: Served, dirs: dict[str, Path]) -> None:
    cards = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [("tiny-base", None), ("sql", "tiny-base"), ("chat", "tiny-base")]
    assert cards[1]["root"] == str(dirs["sql"])
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    assert client.models.retrieve("chat").id == "chat"


def test_each_request_runs_under_the_adapter_its_model_names(server: Served, dirs: dict[str, Path]) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

    def complete(model: str) -> tuple[str, str]:
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        return reply.model, reply.choices[0].text

    names = ["sql", "tiny-base", "chat", "sql", "chat", "tiny-base"]
    with ThreadPoolExecutor(len(names)) as pool:  # concurrent: the adapters and the base share steps
        replies = list(pool.map(complete, names))
    expected = {
        "sql": expected_text(dirs, "sql"),
        "chat": expected_text(dirs, "chat"),
        "tiny-base": expected_text(dirs, None),
    }
    assert len(set(expected.values())) == 3  # the adapters change the answer
    assert replies == [(name, expected[name]) for name in names]
    # Each adapter's own series: two requests of MAX_TOKENS each under sql and under chat.
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    for adapter in ("sql", "chat"):
        tokens = f'metalserve:lora_generation_tokens_total{{lora_name="{adapter}",model_name="tiny-base"}}'
        assert f"{tokens} {2.0 * MAX_TOKENS}" in metrics
        done = f'lora_request_success_total{{finished_reason="length",lora_name="{adapter}",model_name="tiny-base"}}'
        assert f"metalserve:{done} 2.0" in metrics


def test_chat_messages_and_responses_route_by_the_adapter_name(server: Served) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    hi = [{"role": "user", "content": "Hi"}]
    texts = {}
    for model in ("sql", "tiny-base"):
        chat = client.chat.completions.create(model=model, messages=hi, max_tokens=8, temperature=0)  # type: ignore[arg-type]
        assert chat.model == model
        texts[model] = chat.choices[0].message.content
        response = client.responses.create(model=model, input="Hi", max_output_tokens=8, temperature=0)
        assert response.model == model and response.output_text == texts[model]
        claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        message = claude.messages.create(model=model, max_tokens=8, messages=hi, extra_body={"temperature": 0})  # type: ignore[arg-type]
        assert message.model == model and message.content[0].text == texts[model]  # type: ignore[union-attr]
    assert texts["sql"] != texts["tiny-base"]
    stream = client.chat.completions.create(model="sql", messages=hi, max_tokens=8, temperature=0, stream=True)  # type: ignore[arg-type]
    chunks = list(stream)
    assert {c.model for c in chunks} == {"sql"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == texts["sql"]
    with pytest.raises(openai.NotFoundError, match="`nope` does not exist"):
        client.chat.completions.create(model="nope", messages=hi)  # type: ignore[arg-type]


def test_adapters_load_and_unload_at_run_time_behind_the_api_key(dirs: dict[str, Path], tmp_path: Path) -> None:
    config = EngineConfig(model=str(dirs["model"]), kv_cache_memory=1 << 24, enable_lora=True, max_loras=1)
    settings = ServerSettings(log_stats_interval=0, api_key="secret")
    with live(serve_config(config, settings)) as served:
        url, auth = served.url, {"Authorization": "Bearer secret"}
        body = {"lora_name": "sql", "lora_path": str(dirs["sql"])}
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=30).status_code == 401
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth, timeout=30)
        assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'sql' added successfully."
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="secret", max_retries=0)
        reply = client.completions.create(model="sql", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        assert reply.choices[0].text == expected_text(dirs, "sql")
        # --max-loras 1: a second adapter is refused until the first is unloaded.
        second = {"lora_name": "chat", "lora_path": str(dirs["chat"])}
        full = httpx.post(f"{url}/v1/load_lora_adapter", json=second, headers=auth, timeout=30)
        assert full.status_code == 400 and "the most --max-loras allows" in full.json()["error"]["message"]
        bad = httpx.post(f"{url}/v1/load_lora_adapter", json={**second, "lora_path": str(tmp_path)}, headers=auth)
        assert bad.status_code == 400 and "no adapter_config.json in" in bad.json()["error"]["message"]
        gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=auth, timeout=30)
        assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'sql' removed successfully."
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="sql", prompt=PROMPT, max_tokens=2)
        assert [c.id for c in client.models.list().data] == ["tiny-base"]
        again = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=auth, timeout=30)
        assert again.status_code == 404
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=second, headers=auth, timeout=30).status_code == 200
        reply = client.completions.create(model="chat", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        assert reply.model == "chat" and reply.choices[0].text == expected_text(dirs, "chat")


def scaled_copy(folder: Path, to: Path, factor: float) -> Path:
    """The adapter saved again at `factor` times its scale: mlx-lm's fused reference for a lora_scale."""
    shutil.copytree(folder, to)
    config = json.loads((to / "adapter_config.json").read_text())
    config["lora_parameters"]["scale"] *= factor
    (to / "adapter_config.json").write_text(json.dumps(config))
    return to


def test_a_request_scale_is_a_body_field_in_every_api(server: Served, dirs: dict[str, Path], tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

    def complete(model: str, scale: float) -> str:
        body = {"lora_scale": scale}
        reply = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=body
        )
        return str(reply.choices[0].text)

    half = {**dirs, "half": scaled_copy(dirs["sql"], tmp_path / "half", 0.5)}
    assert complete("sql", 0.5) == expected_text(half, "half") != expected_text(dirs, "sql")
    assert complete("sql", 0.0) == expected_text(dirs, None)  # scale 0: the adapter off
    assert complete("sql", 1.0) == expected_text(dirs, "sql")
    hi = [{"role": "user", "content": "Hi"}]
    base = client.chat.completions.create(model="tiny-base", messages=hi, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    off = {"lora_scale": 0.0}
    chat = client.chat.completions.create(model="sql", messages=hi, max_tokens=8, temperature=0, extra_body=off)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == base.choices[0].message.content
    response = client.responses.create(model="sql", input="Hi", max_output_tokens=8, temperature=0, extra_body=off)
    assert response.output_text == base.choices[0].message.content
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    message = claude.messages.create(model="sql", max_tokens=8, messages=hi, extra_body={"temperature": 0, **off})  # type: ignore[arg-type]
    assert message.content[0].text == base.choices[0].message.content  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("model", "scale", "message"),
    [
        ("sql", -0.5, "greater than or equal to 0"),
        ("sql", 9, "less than or equal to 8"),
        ("sql", "big", "valid number"),
        ("tiny-base", 0.5, "lora_scale scales a LoRA adapter's delta; `model` names the base model"),
    ],
)
def test_a_bad_request_scale_is_a_400_in_the_api_shape(server: Served, model: str, scale: object, message: str) -> None:
    body = {"model": model, "prompt": "hi", "max_tokens": 2, "lora_scale": scale}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text
    claude = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "lora_scale": scale}
    reply = httpx.post(f"{server.url}/v1/messages", json=claude, timeout=30)
    assert reply.status_code == 400 and reply.json()["type"] == "error", reply.text
    assert message in reply.json()["error"]["message"], reply.text
