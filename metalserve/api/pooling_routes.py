"""The pooling routes: /v1/embeddings (OpenAI), /pooling, /score and /v1/score (vLLM), /rerank, /v1/rerank and
/v2/rerank (Jina, Cohere). Routed by `model` like every other route; errors in OpenAI's shape (vLLM's)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import Response

from metalserve.api.model_serving import ModelServing, serve_with
from metalserve.api.pooling_protocol import EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest
from metalserve.serving.registry import ModelRegistry


def add_pooling_routes(app: FastAPI, registry: ModelRegistry[ModelServing], alive: Callable[[], None]) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> Response:
        alive()
        return await serve_with(registry, body.model, lambda m: m.pooling.embeddings(body))

    @app.post("/pooling")
    async def pooling(body: PoolingRequest) -> Response:
        alive()
        return await serve_with(registry, body.model, lambda m: m.pooling.pooling(body))

    async def score(body: ScoreRequest) -> Response:
        alive()
        return await serve_with(registry, body.model, lambda m: m.pooling.score(body))

    async def rerank(body: RerankRequest) -> Response:
        alive()
        return await serve_with(registry, body.model, lambda m: m.pooling.rerank(body))

    for path in ("/score", "/v1/score"):
        app.post(path)(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(rerank)
