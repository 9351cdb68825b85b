"""GET /v1/models and /v1/models/{id}, in OpenAI's shape or, for a client that sends `anthropic-version`
(the Anthropic SDK and Claude Code always do), in Anthropic's."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from metalserve.api.anthropic.errors import anthropic_error_body
from metalserve.api.errors import OpenAIError, log_client_error, retry_headers
from metalserve.api.serving_context import ServingContext


def openai_card(ctx: ServingContext, created: int) -> dict[str, Any]:
    engine = ctx.engine
    return {
        "id": ctx.served_model_name,
        "object": "model",
        "created": created,
        "owned_by": "metalserve",
        "root": engine.model_name,
        "max_model_len": engine.max_model_len,
    }


def anthropic_card(ctx: ServingContext, created: int) -> dict[str, Any]:
    """Anthropic's ModelInfo: the context as max_input_tokens, and the largest max_tokens a request may
    ask for (one token of prompt leaves the rest of the context)."""
    limit = ctx.engine.max_model_len
    return {
        "type": "model",
        "id": ctx.served_model_name,
        "display_name": ctx.served_model_name,
        "created_at": datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "lifecycle": "active",
        "max_input_tokens": limit,
        "max_tokens": max(limit - 1, 1),
    }


def wants_anthropic(raw: HTTPRequest) -> bool:
    return "anthropic-version" in raw.headers


def add_model_routes(app: FastAPI, ctx: ServingContext) -> None:
    started = int(time.time())  # the server's start stands in for a release date

    @app.get("/v1/models")
    async def list_models(raw: HTTPRequest) -> dict[str, Any]:
        if wants_anthropic(raw):
            card = anthropic_card(ctx, started)
            return {"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}
        return {"object": "list", "data": [openai_card(ctx, started)]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, raw: HTTPRequest) -> JSONResponse:
        anthropic = wants_anthropic(raw)
        if model_id != ctx.served_model_name:
            error = OpenAIError(f"model: {model_id}" if anthropic else f"The model `{model_id}` does not exist.",
                                404, param="model", code="model_not_found")  # fmt: skip
            log_client_error(raw.url.path, error)
            body = anthropic_error_body(error) if anthropic else error.to_dict()
            return JSONResponse(body, status_code=404, headers=retry_headers(404))
        card = anthropic_card(ctx, started) if anthropic else openai_card(ctx, started)
        return JSONResponse(card)
