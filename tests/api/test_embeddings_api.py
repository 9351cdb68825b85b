"""/v1/embeddings, /score and /rerank through the real threaded server (the embedded SmolLM2 served as a
last-token pooling model, and as a yes/no decoder reranker) and the OpenAI SDK; the vectors and scores
equal a plain mlx forward of the same weights."""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest

from metalserve.api.settings import ServerSettings
from metalserve.config import EngineConfig
from metalserve.executor.models.families import load_model_for
from metalserve.loader import LoadedModel
from metalserve.serving.pooling import QWEN3_RERANKER_TEMPLATE
from tests.api.conftest import Served, live, serve_config

MAX_LEN = 128
TEXTS = ["The cat sat on the mat.", "Paris is the capital of France, a country in Europe.", "2 + 2 = 4"]


@pytest.fixture(scope="module")
def reference() -> Iterator[LoadedModel]:
    loaded = load_model_for(EngineConfig())  # the embedded default, loaded as the server loads it
    yield loaded
    del loaded
    mx.clear_cache()


def last_hidden(loaded: LoadedModel, ids: list[int]) -> np.ndarray:
    return np.array(loaded.model.model(mx.array(ids)[None])[0, -1].astype(mx.float32))


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def cosine(a: Any, b: Any) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))


def pooling_server(name: str, **config: Any) -> Served:
    engine = EngineConfig(runner="pooling", kv_cache_memory=1 << 24, max_model_len=MAX_LEN, **config)
    return serve_config(engine, ServerSettings(served_model_name=((name,),), log_stats_interval=0))


@pytest.fixture(scope="module")
def embedder() -> Iterator[Served]:
    with live(pooling_server("embedder")) as served:
        yield served


def test_sdk_embeddings_equal_the_plain_forward(embedder: Served, reference: LoadedModel) -> None:
    client = openai.OpenAI(base_url=f"{embedder.url}/v1", api_key="x", max_retries=0)
    result = client.embeddings.create(model="embedder", input=TEXTS, user="someone")  # the SDK asks for base64
    tok = reference.tokenizer
    ids = [tok.encode(t) for t in TEXTS]
    assert [d.index for d in result.data] == [0, 1, 2] and result.model == "embedder"
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
    for d, prompt in zip(result.data, ids, strict=True):
        assert len(d.embedding) == reference.config["hidden_size"]
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-4
        assert cosine(d.embedding, last_hidden(reference, prompt)) >= 0.9999
    floats = client.embeddings.create(model="embedder", input=TEXTS[0], encoding_format="float", dimensions=64)
    vector = floats.data[0].embedding
    assert len(vector) == 64 and abs(np.linalg.norm(vector) - 1) < 1e-4  # Matryoshka: cut, then normalised
    np.testing.assert_allclose(vector, unit(last_hidden(reference, ids[0])[:64]), atol=1e-3)


def test_token_id_inputs_base64_and_truncation(embedder: Served, reference: LoadedModel) -> None:
    ids = reference.tokenizer.encode(TEXTS[1])
    url = f"{embedder.url}/v1/embeddings"
    one = httpx.post(url, json={"input": ids, "encoding_format": "base64"}, timeout=60).json()
    vector = np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), dtype="<f4")
    assert cosine(vector, last_hidden(reference, ids)) >= 0.9999
    many = httpx.post(url, json={"input": [ids, ids[:5]], "truncate_prompt_tokens": 4}, timeout=60).json()
    assert many["usage"]["prompt_tokens"] == 8  # both cut to their last 4 tokens
    assert cosine(many["data"][0]["embedding"], last_hidden(reference, ids[-4:])) >= 0.9999
    assert cosine(many["data"][0]["embedding"], many["data"][1]["embedding"]) < 0.9999  # different tails


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/embeddings", {"input": "x " * 300}, 400, "maximum context length is 128"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 100000}, 400, "dimensions must be between 1 and"),
        ("/v1/embeddings", {"input": []}, 400, "input must not be empty"),
        ("/v1/embeddings", {"input": [10**9]}, 400, "outside the vocabulary"),
        ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 500}, 400, "more than max_model_len"),
        ("/v1/embeddings", {"input": "hi", "model": "other"}, 404, "does not exist"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "is a pooling model"),
        ("/v1/completions", {"prompt": "hi"}, 400, "is a pooling model"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400, "text_1 must be one text"),
    ],
)
def test_errors_in_the_openai_shape(
    embedder: Served, path: str, body: dict[str, Any], status: int, fragment: str
) -> None:
    response = httpx.post(f"{embedder.url}{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert fragment in response.json()["error"]["message"]


def test_score_and_rerank_of_an_embedder_are_cosines(embedder: Served) -> None:
    url = embedder.url
    vectors = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS}, timeout=60).json()["data"]
    want = [cosine(vectors[0]["embedding"], v["embedding"]) for v in vectors]
    score = httpx.post(f"{url}/score", json={"text_1": TEXTS[0], "text_2": TEXTS}, timeout=60).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=1e-4)
    body = {"model": "embedder", "query": TEXTS[0], "documents": TEXTS, "top_n": 2, "return_documents": False}
    rerank = httpx.post(f"{url}/v2/rerank", json=body, timeout=60).json()
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in rerank["results"]] == order and "document" not in rerank["results"][0]


def test_metrics_count_pooling_requests_and_their_prompt_tokens(embedder: Served) -> None:
    def counters() -> tuple[float, float]:
        text = httpx.get(f"{embedder.url}/metrics", timeout=30).text
        values = {}
        for line in text.splitlines():
            for name in ("metalserve:pooling_requests_total", "vllm:prompt_tokens_total"):
                if line.startswith(name + '{model_name="embedder"}'):
                    values[name] = float(line.split()[-1])
        return values.get("metalserve:pooling_requests_total", 0.0), values.get("vllm:prompt_tokens_total", 0.0)

    requests_before, tokens_before = counters()
    usage = httpx.post(f"{embedder.url}/v1/embeddings", json={"input": TEXTS}, timeout=60).json()["usage"]
    requests_after, tokens_after = counters()
    assert requests_after - requests_before == len(TEXTS)
    assert tokens_after - tokens_before == usage["prompt_tokens"]


def test_a_generating_model_refuses_embeddings(server: Served) -> None:
    response = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert response.status_code == 400 and "does not serve embeddings" in response.json()["error"]["message"]


def test_decoder_reranker_scores_are_its_yes_no_logits(reference: LoadedModel) -> None:
    overrides = {"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city is Paris."]
    query = "What is the capital of France?"
    tok = reference.tokenizer
    no, yes = tok.encode("no", add_special_tokens=False)[0], tok.encode("yes", add_special_tokens=False)[0]
    want = []
    for doc in docs:
        ids = tok.encode(QWEN3_RERANKER_TEMPLATE.format(query=query, document=doc))
        logits = np.array(reference.model(mx.array(ids)[None])[0, -1].astype(mx.float32))
        want.append(1 / (1 + math.exp(logits[no] - logits[yes])))
    with live(pooling_server("reranker", hf_overrides=overrides)) as served:
        body = {"model": "reranker", "query": query, "documents": docs}
        result = httpx.post(f"{served.url}/v1/rerank", json=body, timeout=120).json()
    got = {r["index"]: r["relevance_score"] for r in result["results"]}
    np.testing.assert_allclose([got[i] for i in range(3)], want, atol=1e-4)
    assert [r["index"] for r in result["results"]] == sorted(range(3), key=lambda i: -want[i])
    assert result["results"][0]["document"]["text"] == docs[result["results"][0]["index"]]
