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
from metalserve.api.model_serving import ModelServing
from metalserve.engine.errors import shown_name
from metalserve.serving.registry import ModelRegistry


def openai_card(info: dict[str, Any], root: str, created: int) -> dict[str, Any]:
    card = {"id": info["id"], "object": "model", "created": created, "owned_by": "metalserve", "root": root}
    return {
        **card,
        "max_model_len": info["max_model_len"],
        "state": info["state"],
        "aliases": info["aliases"],
        "pinned": info["pinned"],
    }


def anthropic_card(info: dict[str, Any], created: int) -> dict[str, Any]:
    """Anthropic's ModelInfo: the context as max_input_tokens, and the largest max_tokens a request may
    ask for (one token of prompt leaves the rest of the context)."""
    limit = info["max_model_len"]
    return {
        "type": "model",
        "id": info["id"],
        "display_name": info["id"],
        "created_at": datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "lifecycle": "active",
        "max_input_tokens": limit,
        "max_tokens": max(limit - 1, 1) if limit else None,
    }


def add_model_routes(app: FastAPI, registry: ModelRegistry[ModelServing]) -> None:
    started = int(time.time())  # the server's start stands in for a release date

    def cards(anthropic: bool) -> list[dict[str, Any]]:
        out = []
        for slot, info in zip(registry.slots, registry.describe(), strict=True):
            root = slot.engine.model_name if slot.engine is not None else (slot.spec.config.model or slot.spec.name)
            out.append(anthropic_card(info, started) if anthropic else openai_card(info, root, started))
        return out

    @app.get("/v1/models")
    async def list_models(raw: HTTPRequest) -> dict[str, Any]:
        if "anthropic-version" in raw.headers:
            data = cards(True)
            return {"data": data, "has_more": False, "first_id": data[0]["id"], "last_id": data[-1]["id"]}
        return {"object": "list", "data": cards(False)}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, raw: HTTPRequest) -> JSONResponse:
        anthropic = "anthropic-version" in raw.headers
        for card in cards(anthropic):
            if card["id"] == model_id:
                return JSONResponse(card)
        error = OpenAIError(
            f"model: {shown_name(model_id)}" if anthropic else f"The model `{shown_name(model_id)}` does not exist.",
            404,
            param="model",
            code="model_not_found",
        )
        log_client_error(raw.url.path, error)
        body = anthropic_error_body(error) if anthropic else error.to_dict()
        return JSONResponse(body, status_code=404, headers=retry_headers(404))
