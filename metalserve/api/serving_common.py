"""What chat and completions share: checks, sampling parameters, fan-out of n, usage and logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request as HTTPRequest
from starlette.requests import ClientDisconnect

from metalserve.api.errors import ContextLengthError, OpenAIError, internal_error
from metalserve.api.protocol import _SamplingRequest
from metalserve.api.serving_context import ServingContext
from metalserve.engine.async_engine import ClientTooSlowError, EngineDeadError, RequestOutput
from metalserve.engine.errors import GrammarFailedError
from metalserve.multimodal.inputs import MultiModalInput
from metalserve.outputs import TokenLogprob
from metalserve.sampling_params import SamplingParams

T = TypeVar("T")
_DONE = object()


def random_id(prefix: str) -> str:
    """A response id in the API's own shape: `chatcmpl-...`, `cmpl-...`; Anthropic's `msg_...` and the
    Responses API's `resp_...` take an underscore. It is also the engine request id (start_generations)."""
    return f"{prefix}{'_' if prefix in ('msg', 'resp') else '-'}{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, default_cap: int = 0) -> int:
    """The output budget: what was asked, checked against the context; absent means the server's default
    cap (`--default-max-tokens`, 0: none) or the rest of the context, whichever is smaller."""
    if prompt_len >= max_model_len:
        raise ContextLengthError(prompt_len, max_model_len)
    room = max_model_len - prompt_len
    if requested is None:
        return min(room, default_cap) if default_cap > 0 else room
    if requested > room:
        raise ContextLengthError(prompt_len, max_model_len, requested)
    return requested


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    bias: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise OpenAIError(f"logit_bias key {key!r} is not a token id", 400, param="logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise OpenAIError(f"logit_bias token id {token_id} is out of vocabulary", 400, param="logit_bias")
        bias[token_id] = value
    return bias


def build_sampling_params(
    req: _SamplingRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    defaults: Mapping[str, float] | None = None,
) -> SamplingParams:
    """Map the request onto SamplingParams; a bad combination becomes a 400. `defaults`: the server's
    values (--override-generation-config) for the sampling fields the request leaves unset."""
    given = defaults or {}

    def pick(name: str, fallback: float) -> float:
        value = getattr(req, name)
        if value is None or name not in req.model_fields_set:  # repetition_penalty has a default of 1
            return given.get(name, fallback if value is None else value)
        return float(value)

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop_ids = list(req.stop_token_ids or [])
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise OpenAIError("stop_token_ids holds an id outside the vocabulary", 400, param="stop_token_ids")
    try:
        return SamplingParams(
            n=1,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=int(pick("top_k", 0)),
            min_p=pick("min_p", 0.0),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", 1.0),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop,
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            logit_bias=_logit_bias(req.logit_bias, vocab_size),
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as exc:
        raise OpenAIError(str(exc), 400) from None


def with_seed(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n samples: its own seed (seed + i), so seeded choices differ but repeat."""
    if params.seed is None or index == 0:
        return params
    return SamplingParams(**{**params.__dict__, "seed": params.seed + index})


def engine_request_ids(response_id: str, n: int) -> list[str]:
    """The engine request ids of one prompt's `n` samples: the response id itself for one sample, so the
    server's log lines and aborts name what the client saw; `<id>-<i>` for each of several."""
    return [response_id] if n == 1 else [f"{response_id}-{i}" for i in range(n)]


def start_generations(
    ctx: ServingContext,
    response_id: str,
    prompt: list[int],
    params: SamplingParams,
    n: int,
    req: _SamplingRequest,
    mm_inputs: list[MultiModalInput] | None = None,
) -> list[AsyncIterator[RequestOutput]]:
    """One engine request per sample; the samples share the prompt, so its prefix is cached.
    `mm_inputs`: the prompt's images (chat)."""
    streams = []
    for i, rid in enumerate(engine_request_ids(response_id, n)):
        sample = with_seed(params, i)
        stream = ctx.engine.generate(
            prompt,
            sample,
            rid,
            priority=req.priority,
            cache_salt=req.cache_salt,
            mm_inputs=mm_inputs,
            lora=ctx.lora_for(req.model, req.lora_scale),
        )
        if ctx.recorder is not None:  # the status page's recent requests
            stream = ctx.recorder.recorded(stream, ctx.served_model_name, rid, len(prompt), ctx.engine.prompt_progress)
        streams.append(stream)
    return streams


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several streams as items arrive; closing the merge closes (aborts) them all."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        except Exception as exc:
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def engine_error(exc: Exception) -> OpenAIError:
    """What the client sees when the engine fails a request."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):  # its messages never carry the core's internals
        return OpenAIError(str(exc), 503)
    if isinstance(exc, ClientTooSlowError):
        return OpenAIError(str(exc), 408)
    if isinstance(exc, GrammarFailedError):
        return OpenAIError(str(exc), 500)
    if isinstance(exc, ValueError):  # the core refused the request itself (its messages are ours)
        return OpenAIError(str(exc), 400)
    return internal_error(exc)


async def cancel_on_disconnect(raw: HTTPRequest, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work`, cancelling it (and so aborting its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work())

    async def watch() -> None:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    client_gone = False
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        client_gone = task not in done
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if client_gone:
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnect()  # answered quietly (errors.py): there is nobody to send an answer to
    return await task


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass
class ChoiceState:
    """One choice's totals while its outputs arrive."""

    text: str = ""
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.num_tokens = out.num_output_tokens
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if out.logprobs:
            self.logprobs = (self.logprobs or []) + out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs


async def collect(streams: list[AsyncIterator[RequestOutput]]) -> list[ChoiceState]:
    """Run every stream to its end (non-streamed responses)."""
    choices = [ChoiceState() for _ in streams]
    try:
        async for index, out in merge_streams(streams):
            choices[index].add(out)
    except Exception as exc:
        raise engine_error(exc) from exc
    return choices


def total_usage(choices: list[ChoiceState], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (its n samples share it); completions count per choice."""
    firsts = choices[::n]
    return usage(
        sum(c.num_prompt_tokens for c in firsts),
        sum(c.num_tokens for c in choices),
        sum(c.num_cached_tokens for c in firsts),
    )


def sse_data(payload: dict[str, Any] | str) -> dict[str, str]:
    """One server-sent event; the OpenAI stream is `data: <json>` lines ending with `data: [DONE]`."""
    return {"data": payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}
