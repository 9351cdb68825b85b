"""The async engine's per-request state, and how results cross from the worker thread to the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from metalserve.engine.detokenizer import IncrementalDetokenizer
from metalserve.engine.errors import ClientTooSlowError
from metalserve.engine.request_output import IterationStats, RequestOutput
from metalserve.outputs import EngineCoreOutput
from metalserve.request import Request

# Deltas a stream's reader may leave unread before its request is aborted: a client that stops reading
# must not make the server buffer its whole output (it is about that many tokens behind).
MAX_UNREAD_OUTPUTS = 2048


@dataclass
class RequestState:
    loop: asyncio.AbstractEventLoop  # the caller's loop: results are handed over on it
    loop_queue: asyncio.Queue[RequestOutput | BaseException]
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int
    on_overflow: Callable[[], None]
    arrival_time: float = field(default_factory=time.monotonic)
    last_token_time: float = 0.0
    num_output_tokens: int = 0
    overflowed: bool = False  # event loop only
    # The core's view of the request (worker thread); its num_computed_tokens shows the prefill's progress.
    request: Request | None = None
    # Prompt tokens counted in the stats so far: they grow as prefill chunks are computed (worker thread
    # writes, the event loop may read: a plain int).
    prompt_done: int = 0


def count_prefill(states: Iterable[RequestState], iteration: IterationStats) -> None:
    """Count the prompt tokens each request's prefill got through since the last step, so throughput
    follows a long prefill as it happens instead of landing all at once with the first token. Prefix-cache
    hits count when they are found, as part of the prompt; tokens recomputed after a preemption count once."""
    for state in states:
        if state.prompt_done >= state.num_prompt_tokens or state.request is None:
            continue
        done = min(state.request.num_computed_tokens, state.num_prompt_tokens)
        if done > state.prompt_done:
            iteration.num_prompt_tokens += done - state.prompt_done
            state.prompt_done = done


def make_output(out: EngineCoreOutput, state: RequestState, now: float, iteration: IterationStats) -> RequestOutput:
    """Detokenize one core output into the delta its stream gets, counting it in this step's stats.

    Tokens after the one that completed a stop string are dropped (a verified speculative window
    brings several at once), so token ids, logprobs and usage end where the text does."""
    detok = state.detokenizer
    text = detok.update(out.new_token_ids, finished=out.finished)
    token_ids, logprobs = out.new_token_ids, out.new_logprobs
    if detok.num_used < len(token_ids):
        token_ids = token_ids[: detok.num_used]
        logprobs = logprobs[: detok.num_used] if logprobs is not None else None
    n_new = len(token_ids)
    if n_new:
        if state.num_output_tokens == 0:
            iteration.num_prompt_tokens += state.num_prompt_tokens - state.prompt_done  # what count_prefill left
            state.prompt_done = state.num_prompt_tokens
            iteration.time_to_first_tokens.append(now - state.arrival_time)
        else:
            iteration.inter_token_latencies.append((now - state.last_token_time) / n_new)
        state.last_token_time = now
        state.num_output_tokens += n_new
        iteration.num_generation_tokens += n_new
    lora = state.request.lora if state.request is not None else None
    if lora is not None:  # the per-adapter series (metrics.py)
        iteration.lora_generation_tokens[lora.name] = iteration.lora_generation_tokens.get(lora.name, 0) + n_new
    if out.pooled is not None:  # a pooling request: its prompt is all it computed
        iteration.num_prompt_tokens += state.num_prompt_tokens - state.prompt_done  # what count_prefill left
        state.prompt_done = state.num_prompt_tokens
        iteration.num_pooling_requests += 1
    finish_reason, stop_reason = out.finish_reason, out.stop_reason
    if detok.stop_reason is not None:
        finish_reason, stop_reason = "stop", detok.stop_reason
    if finish_reason is not None:
        iteration.finished.append((finish_reason, now - state.arrival_time))
        if lora is not None:
            iteration.lora_finished.append((lora.name, finish_reason))
    return RequestOutput(
        request_id=out.request_id,
        text=text,
        token_ids=list(token_ids),
        logprobs=logprobs,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        num_prompt_tokens=out.num_prompt_tokens or state.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        num_output_tokens=state.num_output_tokens,
        prompt_logprobs=out.prompt_logprobs,
        pooled=out.pooled,
    )


Delivery = tuple[RequestState, RequestOutput | BaseException]


def hand_over(deliveries: list[Delivery]) -> None:
    """Queue results on their callers' event loops, one call per loop (usually there is one loop)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}
    for delivery in deliveries:
        by_loop.setdefault(delivery[0].loop, []).append(delivery)
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(_deliver, items)


def _deliver(deliveries: list[Delivery]) -> None:
    for state, item in deliveries:
        if state.overflowed:
            continue
        if state.loop_queue.qsize() >= MAX_UNREAD_OUTPUTS:
            state.overflowed = True
            state.loop_queue.put_nowait(ClientTooSlowError("the client stopped reading the stream"))
            state.on_overflow()
            continue
        state.loop_queue.put_nowait(item)
