"""POST /v1/chat/completions: messages through the chat template, tool calls parsed from the text."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from metalserve.api.deltas import ChoiceDelta, OutputParsing
from metalserve.api.errors import OpenAIError
from metalserve.api.generic_tools import template_renders_tools, with_generic_tools
from metalserve.api.images import content_chars, image_error, read_images, template_content
from metalserve.api.keepalive import with_keepalive
from metalserve.api.logprobs_format import TokenText, chat_logprobs
from metalserve.api.protocol import ChatCompletionRequest, ChatMessage
from metalserve.api.reasoning import ReasoningParser, gate_on_reasoning
from metalserve.api.serving_common import (
    ChoiceState,
    build_sampling_params,
    cancel_on_disconnect,
    collect,
    engine_error,
    merge_streams,
    now,
    random_id,
    resolve_max_tokens,
    sse_data,
    start_generations,
    total_usage,
)
from metalserve.api.serving_context import ServingContext, check_sequence_count
from metalserve.api.structured import auto_tool_params, chat_structured, check_compiles
from metalserve.api.tool_choice import is_forced
from metalserve.api.tool_parsers import GenericToolParser, ToolCallDelta, ToolParser
from metalserve.engine.async_engine import RequestOutput
from metalserve.multimodal.images import ImageError
from metalserve.multimodal.inputs import MultiModalInput

logger = logging.getLogger(__name__)
# chat_template_kwargs may not override how the template is called.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "tools", "tokenize", "chat_template", "return_dict"}


def message_dict(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it; tool-call arguments become objects, as HF templates assume."""
    out: dict[str, Any] = {"role": message.role, "content": template_content(message)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:
                arguments: Any = json.loads(call.function.arguments)
            except ValueError:
                arguments = call.function.arguments
            calls.append(
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments},
                }
            )
        out["tool_calls"] = calls
    return out


def tool_call_delta_json(delta: ToolCallDelta) -> dict[str, Any]:
    """The first delta of a call carries id, type and name (the OpenAI SDK merges on that)."""
    if delta.id is not None:
        function = {"name": delta.name, "arguments": delta.arguments}
        return {"index": delta.index, "id": delta.id, "type": "function", "function": function}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


@dataclass
class Prompt:
    """A rendered prompt: its token ids (image placeholders expanded) and its images, in prompt order."""

    token_ids: list[int]
    images: list[MultiModalInput]


@dataclass
class Generation:
    """A started chat-form request: its id (the response's, and its engine requests'), its prompt, its n
    engine streams and how their output is split."""

    request_id: str
    prompt: list[int]
    streams: list[AsyncIterator[RequestOutput]]
    parsing: OutputParsing
    max_tokens: int = 0  # the output budget it runs with (asked, the server's default cap, or the context)
    context_bound: bool = False  # the budget is the room left in the context: "length" means the context ended

    def length_reason(self, num_output_tokens: int) -> str:
        """Why a "length" finish happened: the context ran out, or the output budget did."""
        return "context_length" if self.context_bound and num_output_tokens >= self.max_tokens else "max_tokens"


class ChatServing:
    """Renders the conversation, runs n engine requests and builds the chat response or stream.

    `start` is the one engine call of every chat-form API (chat, Anthropic Messages, Responses).
    """

    def __init__(
        self,
        ctx: ServingContext,
        tool_parser: ToolParser | None,
        reasoning_parser: ReasoningParser | None = None,
        *,
        auto_tools: bool = False,
        generic_tool_prompt: bool = True,
        tool_call_grammar: bool = True,
    ) -> None:
        self.ctx = ctx
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.auto_tools = auto_tools  # --enable-auto-tool-choice
        self.tool_call_grammar = tool_call_grammar  # --tool-call-grammar: `auto` calls follow their schema
        self.special_tokens = frozenset(ctx.engine.tokenizer.get_added_vocab())
        self.token_text = TokenText(ctx.engine.tokenizer)
        # Tools in the server's generic form where the template drops them (api/generic_tools.py).
        self.generic_tools = generic_tool_prompt and not template_renders_tools(ctx.engine.tokenizer, self._template())
        if self.generic_tools:
            logger.warning(
                "the chat template does not render `tools`: the server describes them in the system message "
                "itself and reads calls back as <tool_call> JSON blocks (--no-generic-tool-prompt: off)"
            )
            self.tool_parser = GenericToolParser()
        if self.grammar_for_tools():
            # The grammar engine's vocabulary takes seconds to build (minutes on a busy CPU): build it now,
            # in the background, rather than inside an agent's first request.
            ctx.engine.grammar.tokenizer_ready()

    def grammar_for_tools(self) -> bool:
        """Whether `auto` tool calls of this model get a lazy call grammar (its parser has one)."""
        parser = self.tool_parser
        if not self.tool_call_grammar or parser is None:
            return False
        return type(parser).call_grammar is not ToolParser.call_grammar

    async def create(self, req: ChatCompletionRequest, raw: HTTPRequest) -> Response:
        gen = await self.start(req)
        if req.stream:
            return EventSourceResponse(self._stream(req, gen), sep="\n")
        choices = await cancel_on_disconnect(raw, lambda: collect(gen.streams))
        return JSONResponse(self._response(req, choices, gen))

    async def start(self, req: ChatCompletionRequest, id_prefix: str = "chatcmpl") -> Generation:
        """Check, render and submit the request; errors before any engine work are OpenAIErrors.
        `id_prefix`: the calling API's response id prefix (random_id)."""
        self.ctx.check_model(req.model, req.lora_scale)
        parse_tools = self._parse_tools(req)
        check_sequence_count(1, req.n)
        rendered = await self.render_off_loop(req)
        prompt = rendered.token_ids
        engine = self.ctx.engine
        requested = req.max_completion_tokens or req.max_tokens
        max_tokens = resolve_max_tokens(requested, len(prompt), engine.max_model_len, self.ctx.default_max_tokens)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = build_sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=logprobs,
            vocab_size=len(engine.tokenizer),
            defaults=self.ctx.sampling_defaults,
        )
        params.structured_outputs, source = chat_structured(req)
        if params.structured_outputs is None and parse_tools is not None and self.tool_call_grammar:
            params.structured_outputs = await auto_tool_params(self.ctx, parse_tools, req, self.special_tokens)
        if parse_tools is not None and parse_tools.keeps_special_tokens:
            params.skip_special_tokens = False  # the call markers are special tokens
        await check_compiles(self.ctx, params.structured_outputs, source)
        parsing = self._parsing(req, prompt, parse_tools)
        if parsing.reasoning is not None and parsing.reasoning.keeps_special_tokens:
            params.skip_special_tokens = False  # its markers are special tokens
        gate_on_reasoning(params, self.reasoning_parser, engine.tokenizer)
        request_id = random_id(id_prefix)
        streams = start_generations(self.ctx, request_id, prompt, params, req.n, req, mm_inputs=rendered.images)
        context_bound = max_tokens == engine.max_model_len - len(prompt) and max_tokens != requested
        return Generation(request_id, prompt, streams, parsing, max_tokens, context_bound)

    def _parsing(self, req: ChatCompletionRequest, prompt: list[int], parse_tools: ToolParser | None) -> OutputParsing:
        tail = ""
        if self.reasoning_parser is not None:
            tail = str(self.ctx.engine.tokenizer.decode(prompt[-8:], skip_special_tokens=False))
        return OutputParsing(
            reasoning=self.reasoning_parser,
            tools=parse_tools,
            forced=req.tool_choice if is_forced(req.tool_choice) else None,
            prompt_tail=tail,
            single_call=req.parallel_tool_calls is False,
        )

    def _parse_tools(self, req: ChatCompletionRequest) -> ToolParser | None:
        """The --tool-call-parser for this request when its output goes through it (tool_choice "auto")."""
        choice = req.tool_choice
        if is_forced(choice) or choice == "none" or (choice is None and not req.tools):
            return None
        if not (self.auto_tools and self.tool_parser is not None):  # "auto", given or implied by tools
            raise OpenAIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                400,
                param="tool_choice",
            )
        return self.tool_parser.for_request(req.tools) if req.tools else None

    async def render_off_loop(self, req: ChatCompletionRequest) -> Prompt:
        """`render_prompt` in the tokenizer thread, after refusing a conversation too long to fit by its length."""
        await self.ctx.check_prompt_chars(sum(content_chars(m) for m in req.messages), "messages")
        return await self.ctx.off_loop(self.render_prompt, req)

    def render_prompt(self, req: ChatCompletionRequest) -> Prompt:
        """The prompt's token ids with each image's placeholder tokens, and the images for the engine."""
        processor = self.ctx.engine.image_processor
        images = read_images(req.messages, self.ctx.image_limits, processor is not None)
        tokens = self.render(req)
        if processor is None or not images:
            return Prompt(tokens, [])
        try:
            tokens, inputs = processor.process(tokens, images)
        except ImageError as exc:
            raise image_error(str(exc), "messages") from None
        return Prompt(tokens, inputs)

    def _template(self) -> str | None:
        return self.ctx.engine.chat_template or getattr(self.ctx.engine.tokenizer, "chat_template", None)

    def render(self, req: ChatCompletionRequest) -> list[int]:
        """The prompt's token ids: the conversation (and tools) through the chat template (an image is the
        one image token the template writes for it; `render_prompt` expands it)."""
        tokenizer = self.ctx.engine.tokenizer
        template = self._template()
        if not template:
            raise OpenAIError("this model has no chat template; start the server with --chat-template", 400)
        # The tools as the client wrote them: fields it left out (description, strict) are not rendered as
        # nulls, which a small model reads as part of the tool (the schemas inside are dicts, kept whole).
        tools = (
            None if req.tool_choice == "none" or not req.tools else [t.model_dump(exclude_none=True) for t in req.tools]
        )
        messages = [message_dict(m) for m in req.messages]
        if self.generic_tools:
            messages, tools = with_generic_tools(messages, tools), None
        extra = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=req.add_generation_prompt,
                tokenize=False,
                chat_template=template,
                **extra,
            )
        except Exception as exc:  # template errors (e.g. roles out of order) are the request's fault
            raise OpenAIError(f"chat template failed: {exc}", 400, param="messages") from None
        return list(tokenizer.encode(str(text), add_special_tokens=False))

    @staticmethod
    def _message(choice: ChoiceState, parsing: OutputParsing) -> tuple[dict[str, Any], str | None]:
        final = parsing.final(choice.text, choice.finish_reason)
        message: dict[str, Any] = {"role": "assistant"}
        if parsing.reasoning is not None:
            message["reasoning_content"] = final.reasoning or None
        message["content"] = final.content
        if final.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in final.tool_calls
            ]
        return message, final.finish_reason

    def _response(self, req: ChatCompletionRequest, choices: list[ChoiceState], gen: Generation) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            message, reason = self._message(c, gen.parsing)
            logprobs = None
            if req.logprobs:
                text = self.token_text.for_request(req.return_tokens_as_token_ids)
                logprobs = {"content": chat_logprobs(c.logprobs or [], req.top_logprobs or 0, text)}
            out.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return {
            "id": gen.request_id,
            "object": "chat.completion",
            "created": now(),
            "model": self.ctx.model_id(req.model),
            "choices": out,
            "usage": total_usage(choices, req.n),
        }

    async def _stream(self, req: ChatCompletionRequest, gen: Generation) -> AsyncIterator[dict[str, str]]:
        streams = gen.streams
        head = {"id": gen.request_id, "object": "chat.completion.chunk", "created": now()}
        head["model"] = self.ctx.model_id(req.model)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        tail = {"usage": None} if include_usage else {}
        parsers = [gen.parsing.streamer(i) for i in range(len(streams))]
        totals = [ChoiceState() for _ in streams]
        for i in range(len(streams)):
            role = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield sse_data({**head, "choices": [role], **tail})
        try:
            async for item in with_keepalive(merge_streams(streams)):
                if item is None:  # a long prefill: an empty delta resets the client's idle timer
                    waiting = [_empty_delta(i) for i, t in enumerate(totals) if t.finish_reason is None]
                    yield sse_data({**head, "choices": waiting[:1], **tail})
                    continue
                index, out = item
                totals[index].add(out)
                choice = self._chunk_choice(req, parsers[index].feed(out))
                if choice is not None:
                    yield sse_data({**head, "choices": [choice], **tail})
            if include_usage:
                yield sse_data({**head, "choices": [], "usage": total_usage(totals, req.n)})
        except Exception as exc:
            yield sse_data(engine_error(exc).to_dict())
        yield sse_data("[DONE]")

    def _chunk_choice(self, req: ChatCompletionRequest, d: ChoiceDelta) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.content:
            delta["content"] = d.content
        if d.tool_calls:
            delta["tool_calls"] = [tool_call_delta_json(c) for c in d.tool_calls]
        logprobs = None
        if req.logprobs and d.logprobs:
            text = self.token_text.for_request(req.return_tokens_as_token_ids)
            logprobs = {"content": chat_logprobs(d.logprobs, req.top_logprobs or 0, text)}
        if not delta and d.finish_reason is None and logprobs is None:
            return None
        return {
            "index": d.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
        }


def _empty_delta(index: int) -> dict[str, Any]:
    """A chunk that adds nothing (the role chunk already set content to "") but is a real event."""
    return {"index": index, "delta": {"content": ""}, "logprobs": None, "finish_reason": None}
