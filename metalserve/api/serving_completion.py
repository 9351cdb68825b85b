"""POST /v1/completions: prompts (text or token ids) in, choices out, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from metalserve.api.errors import OpenAIError
from metalserve.api.logprobs_format import (
    TokenText,
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
    prompt_logprobs_items,
)
from metalserve.api.protocol import CompletionRequest
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
from metalserve.api.structured import check_compiles, completion_structured
from metalserve.engine.async_engine import RequestOutput
from metalserve.outputs import TokenLogprob
from metalserve.structured.params import StructuredOutputsParams


class CompletionServing:
    """Turns a CompletionRequest into engine requests (one per prompt and sample) and a response."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.token_text = TokenText(ctx.engine.tokenizer)

    async def create(self, req: CompletionRequest, raw: HTTPRequest) -> Response:
        self.ctx.check_model(req.model, req.lora_scale)
        if req.suffix:
            raise OpenAIError("suffix is not supported", 400, param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError("best_of must equal n (or be left out)", 400, param="best_of")
        items = self._prompt_items(req.prompt)
        check_sequence_count(len(items), req.n)
        for item in items:
            if isinstance(item, str):
                await self.ctx.check_prompt_chars(len(item), "prompt")
        prompts = await self.ctx.off_loop(self._tokenize, items)
        structured, source = completion_structured(req)
        await check_compiles(self.ctx, structured, source)
        response_id, streams = self._start(req, prompts, structured)
        if req.stream:
            return EventSourceResponse(self._stream(req, prompts, response_id, streams), sep="\n")
        choices = await cancel_on_disconnect(raw, lambda: collect(streams))
        return JSONResponse(self._response(req, prompts, response_id, choices))

    @staticmethod
    def _prompt_items(prompt: Any) -> list[Any]:
        """The prompts of the call: a string or token ids, or a list of either."""
        return prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]

    def _tokenize(self, items: list[Any]) -> list[list[int]]:
        tokenizer = self.ctx.engine.tokenizer
        result: list[list[int]] = []
        for item in items:
            ids = list(tokenizer.encode(item)) if isinstance(item, str) else list(item)
            if not ids:
                raise OpenAIError("prompt must not be empty", 400, param="prompt")
            if any(not 0 <= t < len(tokenizer) for t in ids):
                raise OpenAIError("prompt holds a token id outside the vocabulary", 400, param="prompt")
            result.append(ids)
        return result

    def _start(
        self, req: CompletionRequest, prompts: list[list[int]], structured: StructuredOutputsParams | None
    ) -> tuple[str, list[AsyncIterator[RequestOutput]]]:
        """The response id and one engine stream per (prompt, sample)."""
        engine = self.ctx.engine
        response_id = random_id("cmpl")
        streams: list[AsyncIterator[RequestOutput]] = []
        for p, prompt in enumerate(prompts):
            max_tokens = resolve_max_tokens(
                req.max_tokens, len(prompt), engine.max_model_len, self.ctx.default_max_tokens
            )
            params = build_sampling_params(
                req,
                max_tokens=max_tokens,
                logprobs=req.logprobs,
                vocab_size=len(engine.tokenizer),
                defaults=self.ctx.sampling_defaults,
            )
            params.structured_outputs = structured
            params.prompt_logprobs = self._prompt_top(req)
            # One prompt's engine requests are named by the response id itself; several prompts' by `<id>-<p>`.
            prompt_id = response_id if len(prompts) == 1 else f"{response_id}-{p}"
            streams += start_generations(self.ctx, prompt_id, prompt, params, req.n, req)
        return response_id, streams

    @staticmethod
    def _prompt_top(req: CompletionRequest) -> int | None:
        """The prompt logprobs to compute: vLLM's `prompt_logprobs`, or those `echo` with `logprobs` shows."""
        echoed = req.logprobs if req.echo and req.logprobs is not None else None
        if req.prompt_logprobs is None:
            return echoed
        return max(req.prompt_logprobs, echoed or 0)

    def _prompt_fields(
        self, req: CompletionRequest, prompt: list[int], entries: list[TokenLogprob | None] | None, index: int
    ) -> tuple[dict[str, list[Any]] | None, dict[str, Any]]:
        """(the echoed prompt's logprobs columns, extra choice fields) for a choice's first piece."""
        if entries is None:
            return None, {}
        extra = {}
        if req.prompt_logprobs is not None:
            top = req.prompt_logprobs
            trimmed = [None if e is None else replace(e, top=e.top[:top]) for e in entries]
            extra["prompt_logprobs"] = prompt_logprobs_items(trimmed, self.token_text)
        echoed = None
        if req.echo and req.logprobs is not None:
            as_text = self.token_text.for_request(req.return_tokens_as_token_ids)
            echoed = echo_logprobs(prompt, entries, req.logprobs, as_text)
        return echoed, extra

    def _echo(self, req: CompletionRequest, prompts: list[list[int]], index: int) -> str:
        if not req.echo:
            return ""
        return str(self.ctx.engine.tokenizer.decode(prompts[index // req.n], skip_special_tokens=True))

    def _response(
        self, req: CompletionRequest, prompts: list[list[int]], response_id: str, choices: list[ChoiceState]
    ) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            echo = self._echo(req, prompts, i)
            logprobs = None
            if req.logprobs is not None and c.logprobs is not None:
                text = self.token_text.for_request(req.return_tokens_as_token_ids)
                logprobs = completion_logprobs(c.logprobs, req.logprobs, text, len(echo))
            echoed, extra = self._prompt_fields(req, prompts[i // req.n], c.prompt_logprobs, i)
            if echoed is not None:
                logprobs = join_logprobs(echoed, logprobs)
            out.append(
                {
                    "index": i,
                    "text": echo + c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    **extra,
                }
            )
        return {
            "id": response_id,
            "object": "text_completion",
            "created": now(),
            "model": self.ctx.model_id(req.model),
            "choices": out,
            "usage": total_usage(choices, req.n),
        }

    async def _stream(
        self,
        req: CompletionRequest,
        prompts: list[list[int]],
        response_id: str,
        streams: list[AsyncIterator[RequestOutput]],
    ) -> AsyncIterator[dict[str, str]]:
        head = {"id": response_id, "object": "text_completion", "created": now()}
        head["model"] = self.ctx.model_id(req.model)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        offsets = [0] * len(streams)
        totals = [ChoiceState() for _ in streams]
        echoed: set[int] = set()
        try:
            async for index, out in merge_streams(streams):
                text = ("" if index in echoed else self._echo(req, prompts, index)) + out.text
                echoed.add(index)
                totals[index].add(out)
                if not (text or out.finished or out.logprobs or out.prompt_logprobs):
                    continue
                choice = self._chunk_choice(req, index, out, text, offsets[index], prompts[index // req.n])
                offsets[index] += len(text)
                yield sse_data({**head, "choices": [choice], **({"usage": None} if include_usage else {})})
            if include_usage:
                yield sse_data({**head, "choices": [], "usage": total_usage(totals, req.n)})
        except Exception as exc:
            yield sse_data(engine_error(exc).to_dict())
        yield sse_data("[DONE]")

    def _chunk_choice(
        self, req: CompletionRequest, index: int, out: RequestOutput, text: str, offset: int, prompt: list[int]
    ) -> dict[str, Any]:
        echoed, extra = self._prompt_fields(req, prompt, out.prompt_logprobs, index)
        logprobs = None
        if req.logprobs is not None and out.logprobs:
            start = offset + len(text) - len(out.text)  # the generated text follows the echoed prompt
            as_text = self.token_text.for_request(req.return_tokens_as_token_ids)
            logprobs = completion_logprobs(out.logprobs, req.logprobs, as_text, start)
        if echoed is not None:
            logprobs = join_logprobs(echoed, logprobs)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
            **extra,
        }
