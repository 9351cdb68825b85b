"""The FastAPI application: routes only; the work is in the serving classes."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

import metalserve
from metalserve.api.anthropic.errors import anthropic_error_body
from metalserve.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from metalserve.api.body_limit import BodyLimitMiddleware
from metalserve.api.errors import ErrorShapes, OpenAIError, install_error_handlers
from metalserve.api.frontend import Frontend
from metalserve.api.lora_routes import add_lora_routes
from metalserve.api.memory import memory_report
from metalserve.api.metrics import MetricSeries
from metalserve.api.model_serving import ModelServing, serve_with
from metalserve.api.models import add_model_routes
from metalserve.api.pooling_routes import add_pooling_routes
from metalserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from metalserve.api.responses.errors import responses_error_body
from metalserve.api.responses.protocol import ResponsesRequest
from metalserve.api.responses.serving import ResponsesServing
from metalserve.api.responses.store import ResponseStore
from metalserve.api.settings import ServerSettings
from metalserve.api.status import add_status_routes
from metalserve.api.text_guard import TextCheckedRoute
from metalserve.engine.async_engine import DEAD_MESSAGE
from metalserve.serving.registry import ModelRegistry

_stats_logger = logging.getLogger("metalserve.stats")

# Paths a load balancer or supervisor must reach without the key, and the web page (which holds no data:
# it asks for the key and sends it with every API call).
_OPEN_PATHS = {"/health", "/", "/favicon.ico"}
_OPEN_PREFIXES = ("/web/",)


# Error shapes by path: Anthropic's routes answer in Anthropic's format, everything else in OpenAI's.
ERROR_SHAPES = ErrorShapes([("/v1/messages", anthropic_error_body), ("/v1/responses", responses_error_body)])


class ApiKeyMiddleware:
    """Key check on every path but /health: `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY`
    (Anthropic). Plain ASGI, so streaming is untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # CORS preflights carry no credentials by design; CORSMiddleware (outside this one) answers them.
        path = scope.get("path", "")
        is_open = path in _OPEN_PATHS or path.startswith(_OPEN_PREFIXES)
        if scope["type"] != "http" or is_open or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        # The scheme name is case-insensitive (RFC 9110 11.1): "bearer KEY" is as good as "Bearer KEY".
        scheme, _, credentials = headers.get(b"authorization", b"").strip().partition(b" ")
        bearer_ok = scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.key)
        if bearer_ok or hmac.compare_digest(headers.get(b"x-api-key", b""), self.key):
            await self.app(scope, receive, send)
            return
        error = OpenAIError("invalid or missing API key", 401)
        response = ERROR_SHAPES.response(scope["path"], error, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def build_app(registry: ModelRegistry[ModelServing], frontend: Frontend) -> FastAPI:
    """Wire a ready registry (one model or several, its hooks given by `frontend`) to the routes."""
    settings, store, series, recorder = frontend.settings, frontend.store, frontend.series, frontend.recorder
    first = registry.slots[0]

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        registry.start()
        logger_task = asyncio.create_task(_log_stats(registry, settings.log_stats_interval))
        try:
            pinned = [s.spec.name for s in registry.slots if s.spec.pinned and s.engine is None]
            await registry.preload(pinned)
            yield
        finally:
            logger_task.cancel()
            await registry.shutdown(settings.engine_shutdown_timeout)

    app = FastAPI(title="metalserve", version=metalserve.__version__, lifespan=lifespan)
    app.router.route_class = TextCheckedRoute
    install_error_handlers(app, ERROR_SHAPES)
    _add_middleware(app, settings, max(s.max_model_len or s.spec.config.max_model_len or 0 for s in registry.slots))
    app.state.metrics = first.serving.metrics if first.serving is not None else None
    app.state.series = series
    app.state.registry = registry  # what GracefulServer drains: every loaded model
    app.state.responses_store = store

    def alive() -> None:
        if registry.dead_error is not None:
            raise OpenAIError(DEAD_MESSAGE, 503)
        if registry.draining:
            raise OpenAIError("the server is shutting down", 503)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: HTTPRequest) -> Response:
        alive()
        return await serve_with(registry, body.model, lambda m: m.generating().chat.create(body, raw))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: HTTPRequest) -> Response:
        alive()
        return await serve_with(registry, body.model, lambda m: m.generating().completion.create(body, raw))

    _add_agent_routes(app, registry, store, alive)
    add_pooling_routes(app, registry, alive)
    _add_info_routes(app, registry, series)
    _add_token_routes(app, registry)
    add_status_routes(app, registry, recorder)
    return app


def _add_middleware(app: FastAPI, settings: ServerSettings, max_model_len: int) -> None:
    # Middleware added last runs first: CORS, then the key, then the body limit.
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=settings.body_limit(max_model_len),
        shapes=ERROR_SHAPES,
        body_timeout=settings.request_body_timeout,
    )
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(settings.allowed_origins),
        allow_credentials=settings.allow_credentials,
        allow_methods=list(settings.allowed_methods),
        allow_headers=list(settings.allowed_headers),
    )


def _add_info_routes(app: FastAPI, registry: ModelRegistry[ModelServing], series: MetricSeries) -> None:
    """Liveness, version, the model cards and the Prometheus metrics."""

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if registry.dead_error is None else 503)

    app.head("/health", include_in_schema=False)(health)  # load balancers probe with HEAD

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": metalserve.__version__}

    add_model_routes(app, registry)
    add_lora_routes(app, registry)

    @app.get("/metrics")
    async def prometheus() -> Response:
        for slot in registry.slots:
            if slot.footprint is not None and slot.engine is not None:
                series.memory.labels(slot.spec.name).set(slot.footprint)
        return Response(generate_latest(series.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/memory")
    async def memory() -> dict[str, int]:
        return memory_report(list(registry.engines()), app.state.responses_store)


def _add_token_routes(app: FastAPI, registry: ModelRegistry[ModelServing]) -> None:
    """vLLM's /tokenize and /detokenize, in the model's tokenizer thread like every prompt."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        async def run(m: ModelServing) -> Response:
            ctx, tokenizer = m.ctx, m.ctx.engine.tokenizer
            if body.messages is not None:
                req = ChatCompletionRequest(
                    messages=body.messages,
                    tools=body.tools,
                    chat_template_kwargs=body.chat_template_kwargs,
                    add_generation_prompt=body.add_generation_prompt,
                )
                tokens = (await m.chat.render_off_loop(req)).token_ids
            else:
                text = body.prompt or ""
                tokens = await ctx.off_loop(
                    lambda: list(tokenizer.encode(text, add_special_tokens=body.add_special_tokens))
                )
            return JSONResponse({"count": len(tokens), "max_model_len": ctx.engine.max_model_len, "tokens": tokens})

        return await serve_with(registry, body.model, run)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        async def run(m: ModelServing) -> Response:
            tokenizer = m.ctx.engine.tokenizer
            if any(not 0 <= t < len(tokenizer) for t in body.tokens):
                raise OpenAIError("tokens holds an id outside the vocabulary", 400, param="tokens")
            return JSONResponse({"prompt": str(await m.ctx.off_loop(tokenizer.decode, body.tokens))})

        return await serve_with(registry, body.model, run)


def _add_agent_routes(
    app: FastAPI, registry: ModelRegistry[ModelServing], store: ResponseStore, alive: Callable[[], None]
) -> None:
    """Anthropic's Messages and OpenAI's Responses routes (both on ChatServing's engine call)."""

    @app.post("/v1/messages")
    async def anthropic_messages(body: MessagesRequest, raw: HTTPRequest) -> Response:
        alive()
        return await serve_with(registry, body.model, lambda m: m.generating().messages.create(body, raw))

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(body: CountTokensRequest) -> Response:
        async def run(m: ModelServing) -> Response:
            return JSONResponse(await m.messages.count_tokens(body))

        return await serve_with(registry, body.model, run)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: HTTPRequest) -> Response:
        alive()
        return await serve_with(registry, body.model, lambda m: m.generating().responses.create(body, raw))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return ResponsesServing.retrieve_from(store, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return ResponsesServing.delete_from(store, response_id)


async def _log_stats(registry: ModelRegistry[ModelServing], interval: float) -> None:
    if interval <= 0:
        return
    while True:
        await asyncio.sleep(interval)
        loaded = [s for s in registry.slots if s.serving is not None]
        for slot in loaded:
            assert slot.serving is not None
            line = slot.serving.metrics.log_state.line()
            _stats_logger.info(line if len(registry.slots) == 1 else f"{slot.spec.name}: {line}")
