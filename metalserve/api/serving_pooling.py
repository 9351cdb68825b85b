"""The pooling APIs over one model: embeddings (OpenAI's shape), score (vLLM's) and rerank (Jina's and
Cohere's). Every input is one pooling request on the engine (packed into its steps like any other).

Scores: a cross-encoder (a BERT sequence classifier) scores the tokenizer's pair encoding of (query,
document) by its classifier, through a sigmoid; a decoder reranker (`classifier_from_token`, Qwen3-Reranker
style) scores each (query, document) prompt by its last token's two logits, p(true) = sigmoid(true -
false); an embedding model scores by the cosine of the two embeddings, as vLLM does for embedding models."""

from __future__ import annotations

import asyncio
import base64
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse

from metalserve.api.errors import OpenAIError
from metalserve.api.pooling_protocol import EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest
from metalserve.api.serving_context import ServingContext
from metalserve.pooling_params import PoolingModel, PoolingParams
from metalserve.sampling_params import SamplingParams

Prompt = str | list[int]


class PoolingServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def model(self) -> PoolingModel:
        pooling = self.ctx.engine.pooling
        if pooling is None:
            raise OpenAIError(
                f"the model {self.ctx.served_model_name!r} generates text: it does not serve embeddings, score or "
                "rerank (start a pooling model with --runner pooling)",
                400,
                param="model",
            )
        return pooling

    # ---- the routes --------------------------------------------------------------------------------

    async def embeddings(self, body: EmbeddingRequest) -> JSONResponse:
        tokens, vectors = await self._embed(body)
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        return JSONResponse(self._envelope("embd", tokens, data=data))

    async def pooling(self, body: PoolingRequest) -> JSONResponse:
        """vLLM's /pooling: each input's pooled vector, `{"object": "pooling", "data": [...]}`."""
        tokens, vectors = await self._embed(body)
        data = [
            {"object": "pooling", "index": i, "data": _encode(v, body.encoding_format)} for i, v in enumerate(vectors)
        ]
        return JSONResponse(self._envelope("pool", tokens, data=data))

    async def _embed(self, body: EmbeddingRequest) -> tuple[list[list[int]], list[list[float]]]:
        self.ctx.check_model(body.model)
        model = self.model()
        if model.cross_encoder:
            raise OpenAIError(
                f"the model {self.ctx.served_model_name!r} is a cross-encoder: it scores (query, document) pairs "
                "through /score and /rerank, and gives no embeddings",
                400,
                param="model",
            )
        prompts = _embedding_inputs(body.input)
        try:
            params = model.params(body.dimensions)
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, param="dimensions") from None
        if body.normalize is not None:
            params = PoolingParams(params.pooling_type, body.normalize, params.dimensions)
        tokens = await self._tokenize(prompts, body.truncate_prompt_tokens, body.add_special_tokens)
        return tokens, await self._pool(tokens, params, "embd")

    async def score(self, body: ScoreRequest) -> JSONResponse:
        self.ctx.check_model(body.model)
        queries = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        docs = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if len(queries) == 1:
            queries = queries * len(docs)
        if len(queries) != len(docs) or not docs:
            raise OpenAIError("text_1 must be one text, or as many texts as text_2", 400, param="text_1")
        scores, tokens = await self._scores(queries, docs, body.truncate_prompt_tokens)
        data = [{"object": "score", "index": i, "score": s} for i, s in enumerate(scores)]
        return JSONResponse(self._envelope("score", tokens, data=data))

    async def rerank(self, body: RerankRequest) -> JSONResponse:
        self.ctx.check_model(body.model)
        scores, tokens = await self._scores(
            [body.query] * len(body.documents), body.documents, body.truncate_prompt_tokens
        )
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[: body.top_n]
        results: list[dict[str, Any]] = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                result["document"] = {"text": body.documents[i]}
            results.append(result)
        total = sum(map(len, tokens))
        envelope = {"id": f"rerank-{uuid.uuid4().hex}", "model": self.ctx.served_model_name, "results": results}
        return JSONResponse({**envelope, "usage": {"prompt_tokens": total, "total_tokens": total}})

    # ---- the work ----------------------------------------------------------------------------------

    async def _scores(
        self, queries: Sequence[str], docs: Sequence[str], truncate: int | None
    ) -> tuple[list[float], list[list[int]]]:
        """One score per (query, document) pair, and the token ids that made them (for usage)."""
        model = self.model()
        if model.cross_encoder:
            tokens = await self._tokenize_pairs(queries, docs, truncate)
            logits = await self._pool(tokens, PoolingParams("cls", normalize=False, classify=True), "score")
            raw = [float(v[0]) for v in logits]
            return [1.0 / (1.0 + math.exp(-x)) for x in raw] if model.score_sigmoid else raw, tokens
        if model.score_token_ids is not None:
            pairs = [model.score_template.format(query=q, document=d) for q, d in zip(queries, docs, strict=True)]
            tokens = await self._tokenize(list(pairs), truncate, add_special_tokens=True)
            params = PoolingParams("last", normalize=False, logit_token_ids=model.score_token_ids)
            logits = await self._pool(tokens, params, "score")
            return [1.0 / (1.0 + math.exp(float(no) - float(yes))) for no, yes in logits], tokens
        texts = sorted(set(queries) | set(docs))
        tokens = await self._tokenize(list(texts), truncate, add_special_tokens=True)
        vectors = dict(zip(texts, await self._pool(tokens, model.params(), "score"), strict=True))
        scores = [_cosine(vectors[q], vectors[d]) for q, d in zip(queries, docs, strict=True)]
        used = {t: tok for t, tok in zip(texts, tokens, strict=True)}
        return scores, [used[q] + used[d] for q, d in zip(queries, docs, strict=True)]

    async def _tokenize(
        self, prompts: Sequence[Prompt], truncate: int | None, add_special_tokens: bool
    ) -> list[list[int]]:
        engine = self.ctx.engine
        limit = engine.max_model_len
        vocab = len(engine.tokenizer) if engine.tokenizer is not None else None

        def encode() -> list[list[int]]:
            out = []
            for p in prompts:
                ids = engine.tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else p
                out.append(list(ids))
            return out

        tokens = await self.ctx.off_loop(encode)
        keep = limit if truncate == -1 else truncate
        if keep is not None and keep > limit:
            raise OpenAIError(
                f"truncate_prompt_tokens {keep} is more than max_model_len={limit}", 400, param="truncate_prompt_tokens"
            )
        for i, ids in enumerate(tokens):
            if not ids:
                raise OpenAIError(f"input {i} is empty", 400, param="input")
            if vocab is not None and any(not 0 <= t < vocab for t in ids):
                raise OpenAIError(f"input {i} holds a token id outside the vocabulary", 400, param="input")
            if keep is not None and len(ids) > keep:
                tokens[i] = ids[-keep:]  # vLLM's truncation: the last tokens are kept
            elif len(ids) > limit:
                raise OpenAIError(
                    f"This model's maximum context length is {limit} tokens. However, input {i} has {len(ids)} "
                    "tokens. Please reduce the length of the input, or set truncate_prompt_tokens.",
                    400,
                    param="input",
                    code="context_length_exceeded",
                )
        return tokens

    async def _tokenize_pairs(
        self, queries: Sequence[str], docs: Sequence[str], truncate: int | None
    ) -> list[list[int]]:
        """The tokenizer's pair encoding ([CLS] query [SEP] document [SEP] for BERT); a pair over the
        limit is refused, or cut by the tokenizer's longest-first truncation when asked."""
        engine = self.ctx.engine
        limit = engine.max_model_len
        keep = limit if truncate == -1 else truncate
        if keep is not None and keep > limit:
            raise OpenAIError(
                f"truncate_prompt_tokens {keep} is more than max_model_len={limit}", 400, param="truncate_prompt_tokens"
            )

        def encode() -> list[list[int]]:
            cut = {"truncation": "longest_first", "max_length": keep} if keep is not None else {}
            return [list(engine.tokenizer(q, d, **cut)["input_ids"]) for q, d in zip(queries, docs, strict=True)]

        tokens = await self.ctx.off_loop(encode)
        for i, ids in enumerate(tokens):
            if len(ids) > limit:
                raise OpenAIError(
                    f"This model's maximum context length is {limit} tokens. However, pair {i} has {len(ids)} "
                    "tokens. Please reduce the length of the query or document, or set truncate_prompt_tokens.",
                    400,
                    param="documents",
                    code="context_length_exceeded",
                )
        return tokens

    async def _pool(self, tokens: list[list[int]], params: PoolingParams, kind: str) -> list[list[float]]:
        """One pooling request per input, all submitted at once (the scheduler packs them)."""
        sampling = SamplingParams(max_tokens=1, pooling=params)
        base = f"{kind}-{uuid.uuid4().hex}"

        async def one(i: int, ids: list[int]) -> list[float]:
            rid = f"{base}-{i}"
            stream = self.ctx.engine.generate(ids, sampling, rid)
            if self.ctx.recorder is not None:  # the server view lists and counts pooling requests too
                stream = self.ctx.recorder.recorded(
                    stream, self.ctx.served_model_name, rid, len(ids), self.ctx.engine.prompt_progress, kind="pooling"
                )
            vector = None
            async for out in stream:  # to its end, so the recorder lists it as finished at once
                if out.pooled is not None:
                    vector = out.pooled
            if vector is None:
                raise OpenAIError("the engine ended a pooling request without its vector", 500)
            return vector

        try:
            return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(tokens))))
        except ValueError as exc:
            raise OpenAIError(str(exc), 400) from None

    def _envelope(self, kind: str, tokens: list[list[int]], **fields: Any) -> dict[str, Any]:
        total = sum(map(len, tokens))
        return {
            "id": f"{kind}-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": self.ctx.served_model_name,
            **fields,
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }


def _embedding_inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    if isinstance(value, str):
        return [value]
    if not value:
        raise OpenAIError("input must not be empty", 400, param="input")
    if all(isinstance(v, int) for v in value):
        return [list(value)]  # type: ignore[arg-type]
    return list(value)  # type: ignore[arg-type]


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64: the float32 little-endian bytes (the SDK decodes them with NumPy)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def _cosine(a: list[float], b: list[float]) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(x @ y) / max(float(np.linalg.norm(x) * np.linalg.norm(y)), 1e-12)
