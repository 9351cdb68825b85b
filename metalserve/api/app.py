"""The FastAPI application: routes only; the work is in the serving classes."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

import metalserve
from metalserve.api.anthropic.errors import anthropic_error_body
from metalserve.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from metalserve.api.anthropic.serving import MessagesServing
from metalserve.api.body_limit import BodyLimitMiddleware
from metalserve.api.errors import ErrorShapes, OpenAIError, install_error_handlers
from metalserve.api.memory import memory_report
from metalserve.api.metrics import Metrics
from metalserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from metalserve.api.reasoning import get_reasoning_parser
from metalserve.api.responses.protocol import ResponsesRequest
from metalserve.api.responses.serving import ResponsesServing
from metalserve.api.responses.store import ResponseStore
from metalserve.api.serving_chat import ChatServing
from metalserve.api.serving_common import (
    now,
)
from metalserve.api.serving_completion import CompletionServing
from metalserve.api.serving_context import ServingContext
from metalserve.api.settings import ServerSettings
from metalserve.api.text_guard import TextCheckedRoute
from metalserve.api.tool_parsers import get_tool_parser
from metalserve.engine.async_engine import DEAD_MESSAGE, AsyncEngine
from metalserve.structured.compiler import GrammarLimits

# Paths a load balancer or supervisor must reach without the key.
_OPEN_PATHS = {"/health"}


# Error shapes by path: Anthropic's routes answer in Anthropic's format, everything else in OpenAI's.
ERROR_SHAPES = ErrorShapes([("/v1/messages", anthropic_error_body)])


class ApiKeyMiddleware:
    """Key check on every path but /health: `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY`
    (Anthropic). Plain ASGI, so streaming is untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # CORS preflights carry no credentials by design; CORSMiddleware (outside this one) answers them.
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS or scope["method"] == "OPTIONS":
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


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """Wire an AsyncEngine (real or fake core inside) to the OpenAI-compatible routes."""
    metrics = Metrics(settings.served_model_name or engine.model_name)
    if engine.observer is None:
        engine.observer = metrics
    ctx = ServingContext(engine, settings.served_model_name or engine.model_name, settings.image_limits())
    parser = get_tool_parser(settings.tool_call_parser) if settings.tool_call_parser else None
    reasoning = get_reasoning_parser(settings.reasoning_parser) if settings.reasoning_parser else None
    chat = ChatServing(ctx, parser, reasoning, auto_tools=settings.enable_auto_tool_choice)
    completion = CompletionServing(ctx)
    store = ResponseStore(settings.responses_store_size, settings.responses_store_bytes)
    engine.grammar_limits = GrammarLimits(
        max_spec_bytes=settings.max_grammar_bytes,
        compile_timeout_s=settings.grammar_compile_timeout,
        cache_bytes=settings.grammar_cache_bytes,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        logger_task = asyncio.create_task(_log_stats(metrics, settings.log_stats_interval))
        try:
            yield
        finally:
            logger_task.cancel()
            await engine.shutdown(settings.engine_shutdown_timeout)

    app = FastAPI(title="metalserve", version=metalserve.__version__, lifespan=lifespan)
    app.router.route_class = TextCheckedRoute
    install_error_handlers(app, ERROR_SHAPES)
    _add_middleware(app, settings, engine.max_model_len)
    app.state.metrics = metrics
    app.state.engine = engine
    app.state.responses_store = store

    def alive() -> None:
        if engine.dead_error is not None:
            raise OpenAIError(DEAD_MESSAGE, 503)
        if engine.draining:
            raise OpenAIError("the server is shutting down", 503)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: HTTPRequest) -> Response:
        alive()
        return await chat.create(body, raw)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: HTTPRequest) -> Response:
        alive()
        return await completion.create(body, raw)

    _add_agent_routes(app, MessagesServing(chat), ResponsesServing(chat, store), alive)
    _add_info_routes(app, ctx, metrics)
    _add_token_routes(app, ctx, chat)
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


def _add_info_routes(app: FastAPI, ctx: ServingContext, metrics: Metrics) -> None:
    """Liveness, version, the model card and the Prometheus metrics."""
    engine = ctx.engine

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.dead_error is None else 503)

    app.head("/health", include_in_schema=False)(health)  # load balancers probe with HEAD

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": metalserve.__version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": ctx.served_model_name, "object": "model", "created": now(), "owned_by": "metalserve"}
        return {
            "object": "list",
            "data": [{**card, "root": engine.model_name, "max_model_len": engine.max_model_len}],
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/memory")
    async def memory() -> dict[str, int]:
        return memory_report(app.state.engine, app.state.responses_store)


def _add_token_routes(app: FastAPI, ctx: ServingContext, chat: ChatServing) -> None:
    """vLLM's /tokenize and /detokenize, in the tokenizer thread like every prompt."""
    tokenizer = ctx.engine.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        if body.messages is not None:
            req = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
            tokens = (await chat.render_off_loop(req)).token_ids
        else:
            text = body.prompt or ""
            tokens = await ctx.off_loop(
                lambda: list(tokenizer.encode(text, add_special_tokens=body.add_special_tokens))
            )
        return {"count": len(tokens), "max_model_len": ctx.engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        ctx.check_model(body.model)
        if any(not 0 <= t < len(tokenizer) for t in body.tokens):
            raise OpenAIError("tokens holds an id outside the vocabulary", 400, param="tokens")
        return {"prompt": str(await ctx.off_loop(tokenizer.decode, body.tokens))}


def _add_agent_routes(
    app: FastAPI, messages: MessagesServing, responses: ResponsesServing, alive: Callable[[], None]
) -> None:
    """Anthropic's Messages and OpenAI's Responses routes (both on ChatServing's engine call)."""

    @app.post("/v1/messages")
    async def anthropic_messages(body: MessagesRequest, raw: HTTPRequest) -> Response:
        alive()
        return await messages.create(body, raw)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(body: CountTokensRequest) -> dict[str, Any]:
        return await messages.count_tokens(body)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: HTTPRequest) -> Response:
        alive()
        return await responses.create(body, raw)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return responses.delete(response_id)


async def _log_stats(metrics: Metrics, interval: float) -> None:
    if interval <= 0:
        return
    while True:
        await asyncio.sleep(interval)
        metrics.log_state.log()
