"""Served names through the real server: a model file is listed under its readable name (its stem), and the
ids earlier versions served it under (the path as written, the full path) still reach it in every API."""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import openai

from metalserve.config import EngineConfig
from metalserve.serving.model_spec import ModelSpec, served_names
from tests.api.multi_fakes import MB, FakeModels, make_registry, serving

HI = [{"role": "user", "content": "Hi"}]


def test_a_model_file_is_listed_by_its_stem_and_reached_by_its_path(tmp_path: Path) -> None:
    gguf = tmp_path / "Tiny-Chat.Q4_1.gguf"
    gguf.write_bytes(b"")
    names = served_names(str(gguf))
    assert names == ("Tiny-Chat.Q4_1", str(gguf))
    fakes = FakeModels({"Tiny-Chat.Q4_1": MB})
    with serving(make_registry(fakes, [ModelSpec.of(EngineConfig(model=str(gguf)))], budget=None)) as url:
        cards = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert [c["id"] for c in cards] == ["Tiny-Chat.Q4_1"] and cards[0]["aliases"] == [str(gguf)]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        for model in names:
            reply = client.chat.completions.create(model=model, messages=HI)  # type: ignore[arg-type]
            assert reply.choices[0].message.content == "I am Tiny-Chat.Q4_1." and reply.model == "Tiny-Chat.Q4_1"
            response = client.responses.create(model=model, input="Hi")
            assert response.model == "Tiny-Chat.Q4_1"
            claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
            message = claude.messages.create(model=model, max_tokens=32, messages=HI)  # type: ignore[arg-type]
            assert message.model == "Tiny-Chat.Q4_1"
            tokens = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": "Hi"}, timeout=10)
            assert tokens.status_code == 200 and tokens.json()["count"] > 0
        missing = httpx.post(f"{url}/tokenize", json={"model": "Tiny-Chat", "prompt": "Hi"}, timeout=10)
        assert missing.status_code == 404 and "Tiny-Chat.Q4_1" in missing.text
