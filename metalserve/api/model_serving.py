"""One model's serving classes (chat, completions, Messages, Responses over one ServingContext), built
when the model is loaded; and how a response keeps its model's lease until its last byte is sent."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import Response

from metalserve.api.anthropic.serving import MessagesServing
from metalserve.api.errors import OpenAIError
from metalserve.api.metrics import Metrics, MetricSeries
from metalserve.api.parser_detection import choose_parsers
from metalserve.api.reasoning import get_reasoning_parser
from metalserve.api.request_log import RequestRecorder
from metalserve.api.responses.serving import ResponsesServing
from metalserve.api.responses.store import ResponseStore
from metalserve.api.serving_chat import ChatServing
from metalserve.api.serving_completion import CompletionServing
from metalserve.api.serving_context import ServingContext
from metalserve.api.serving_pooling import PoolingServing
from metalserve.api.tool_parsers import get_tool_parser
from metalserve.engine.async_engine import AsyncEngine
from metalserve.multimodal.limits import ImageLimits
from metalserve.serving.registry import ModelRegistry, ModelRegistryError

logger = logging.getLogger(__name__)


@dataclass
class ModelServing:
    """What the routes call for one loaded model."""

    ctx: ServingContext
    chat: ChatServing
    completion: CompletionServing
    messages: MessagesServing
    responses: ResponsesServing
    metrics: Metrics
    pooling: PoolingServing  # embeddings, score, rerank (a pooling model's; others answer 400)

    def generating(self) -> ModelServing:
        """This model, for a generation route: a pooling model answers 400."""
        if self.ctx.engine.pooling is not None:
            raise OpenAIError(
                f"the model {self.ctx.served_model_name!r} is a pooling model: it serves /v1/embeddings, "
                "/score and /rerank, not generation",
                400,
                param="model",
            )
        return self

    def close(self) -> None:
        """The model was unloaded: its tokenizer thread ends (after any task it still runs)."""
        self.ctx.tokenizer_thread.shutdown(wait=False)


@dataclass(frozen=True)
class ServingOptions:
    """A model's parsers and its names (the first is the id responses carry)."""

    names: tuple[str, ...]
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    default_max_tokens: int = 0  # --default-max-tokens
    generic_tool_prompt: bool = True  # --generic-tool-prompt
    tool_call_grammar: bool = True  # --tool-call-grammar
    sampling_defaults: dict[str, float] = field(default_factory=dict)  # --override-generation-config


def make_model_serving(
    engine: AsyncEngine,
    options: ServingOptions,
    store: ResponseStore,
    series: MetricSeries,
    recorder: RequestRecorder,
) -> ModelServing:
    name = options.names[0]
    metrics = Metrics(name, series)
    if engine.observer is None:
        engine.observer = metrics
    ctx = ServingContext(
        engine,
        name,
        options.image_limits,
        aliases=options.names[1:],
        recorder=recorder,
        default_max_tokens=options.default_max_tokens,
        sampling_defaults=options.sampling_defaults,
    )
    template = engine.chat_template or getattr(engine.tokenizer, "chat_template", None)
    parsers = choose_parsers(options.tool_call_parser, options.reasoning_parser, template)
    logger.info("%s: %s", name, parsers.log_line)
    if options.enable_auto_tool_choice and parsers.tool_call_parser is None:
        logger.warning("%s: --enable-auto-tool-choice, but no tool-call parser: name one (--tool-call-parser)", name)
    tools = get_tool_parser(parsers.tool_call_parser) if parsers.tool_call_parser else None
    reasoning = get_reasoning_parser(parsers.reasoning_parser) if parsers.reasoning_parser else None
    chat = ChatServing(
        ctx,
        tools,
        reasoning,
        auto_tools=options.enable_auto_tool_choice,
        generic_tool_prompt=options.generic_tool_prompt,
        tool_call_grammar=options.tool_call_grammar,
    )
    return ModelServing(
        ctx,
        chat,
        CompletionServing(ctx),
        MessagesServing(chat),
        ResponsesServing(chat, store),
        metrics,
        PoolingServing(ctx),
    )


async def serve_with(
    registry: ModelRegistry[ModelServing], model: str | None, call: Callable[[ModelServing], Awaitable[Response]]
) -> Response:
    """Lease the request's model (loading it if needed) for `call` and, for a stream, until it ends."""
    lease = await lease_model(registry, model)
    try:
        response = await call(lease.serving)
    except BaseException:
        lease.release()
        raise
    body = getattr(response, "body_iterator", None)
    if body is None:
        lease.release()
        return response

    async def held() -> AsyncIterator[Any]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            try:
                close = getattr(body, "aclose", None)
                if close is not None:
                    await close()  # the stream's own cleanup (aborting its requests) comes first
            finally:
                lease.release()

    response.body_iterator = held()  # type: ignore[attr-defined]
    return response


async def lease_model(registry: ModelRegistry[ModelServing], model: str | None) -> Any:
    """The registry's lease, its refusals as OpenAIErrors (each API renders them in its own shape)."""
    try:
        return await registry.acquire(model)
    except ModelRegistryError as exc:
        param = "model" if exc.status == 404 else None
        raise OpenAIError(str(exc), exc.status, param=param, code=exc.code) from None
