"""Applying one step's results to its requests: sampled tokens appended with their stop checks, drafts
rolled back and counted, prompt logprobs gathered. Functions over requests; the Scheduler decides which
requests they touch and frees what finishes."""

from __future__ import annotations

from typing import Any, NamedTuple

from metalserve.outputs import EngineCoreOutput
from metalserve.request import Request, RequestStatus
from metalserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from metalserve.scheduler.stop import check_stop
from metalserve.spec_decode.rollback import num_rejected
from metalserve.spec_decode.stats import SpecDecodingCounter


class StopHint(NamedTuple):
    """What may end a request, computed once when it is added: a token that is neither a stop id nor
    reaches `max_output_tokens` cannot end it, so only such tokens need the full check (`check_stop`)."""

    stop_ids: frozenset[int]  # the request's stop ids plus EOS unless ignore_eos
    max_output_tokens: int  # the output count at which max_tokens or the context limit ends it


def stop_hint(request: Request, max_model_len: int) -> StopHint:
    params = request.sampling_params
    max_out = max_model_len - request.num_prompt_tokens
    if params.max_tokens is not None:
        max_out = min(max_out, params.max_tokens)
    return StopHint(params.stop_ids(request.eos_token_ids), max_out)


def append_sampled(
    request: Request, token_ids: list[int], hint: StopHint, max_model_len: int
) -> tuple[int, RequestStatus | None]:
    """Append tokens until one finishes the request: (tokens appended, the finished status or None).

    Most tokens stop nothing: only a possible stop id or a length limit needs the full check. A
    completed grammar is a natural stop and wins over a length limit hit by the same token; a token the
    grammar refused (or EOS where it does not accept) ends the request with an error, not an answer."""
    stop_ids, max_out = hint
    out_ids = request.output_token_ids
    grammar = request.structured
    for num_new, token_id in enumerate(token_ids, 1):
        out_ids.append(token_id)
        if grammar is not None and grammar.accept(token_id):
            if grammar.error is None:
                return num_new, RequestStatus.FINISHED_STOPPED
            request.stop_reason = grammar.error
            return num_new, RequestStatus.FINISHED_ERROR
        if token_id in stop_ids or len(out_ids) >= max_out:
            status = check_stop(request, max_model_len)
            if status is not None:
                return num_new, status
    return len(token_ids), None


def output_of(
    request: Request, token_ids: list[int], num_new: int, runner_output: ModelRunnerOutput
) -> EngineCoreOutput:
    """The output record of the first `num_new` of this step's tokens (with their logprobs, if any)."""
    logprobs = runner_output.logprobs.get(request.request_id) if runner_output.logprobs else None
    return record(
        request,
        token_ids[:num_new] if num_new < len(token_ids) else token_ids,
        new_logprobs=logprobs[:num_new] if logprobs is not None else None,
    )


def record(request: Request, token_ids: list[int], **fields: Any) -> EngineCoreOutput:
    """A request's output record: its new tokens, its prompt and cached token counts, and `fields`."""
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=token_ids,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_cached_tokens=request.num_cached_tokens or 0,
        **fields,
    )


def add_prompt_logprobs(requests: dict[str, Request], runner_output: ModelRunnerOutput) -> None:
    """Extend each request's prompt logprobs (a recomputed chunk after preemption adds nothing new)."""
    for request_id, (first, entries) in runner_output.prompt_logprobs.items():
        request = requests.get(request_id)
        if request is None or request.prompt_logprobs is None:
            continue
        have = request.prompt_logprobs
        have += entries[len(have) - first :] if len(have) >= first else []


def update_drafts(
    requests: dict[str, Request],
    counter: SpecDecodingCounter,
    scheduler_output: SchedulerOutput,
    runner_output: ModelRunnerOutput,
) -> None:
    """Roll back the rejected drafts' positions (only accepted tokens count as computed, so only they
    are ever hashed into the prefix cache), count the drafts, and keep the next step's drafts."""
    running = RequestStatus.RUNNING
    for request_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
        request = requests.get(request_id)
        token_ids = runner_output.sampled_token_ids.get(request_id)
        if request is None or request.status is not running or not token_ids:
            continue
        request.num_computed_tokens -= num_rejected(len(drafts), len(token_ids))
        counter.record(len(drafts), len(token_ids) - 1)
    for request_id in scheduler_output.num_scheduled_tokens:
        request = requests.get(request_id)
        if request is not None:
            request.spec_token_ids = runner_output.spec_token_ids.get(request_id, [])
