"""The second half of a step: append the sampled tokens, check stops, free what finished."""

from __future__ import annotations

from metalserve.kvcache.manager import KVCacheManager
from metalserve.outputs import EngineCoreOutput
from metalserve.request import Request, RequestStatus
from metalserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from metalserve.scheduler.stop import check_stop
from metalserve.spec_decode.stats import SpecDecodingCounter


class StepUpdate:
    """Scheduler's update half (a base class, so both halves stay small files)."""

    kv: KVCacheManager
    max_model_len: int
    requests: dict[str, Request]
    running: list[Request]
    _finished_ids: set[str]
    _pending_finish: dict[str, RequestStatus]
    _pending_outputs: list[EngineCoreOutput]
    _stop_hints: dict[str, tuple[frozenset[int], int]]
    spec_counter: SpecDecodingCounter

    def _remove_waiting(self, ids: set[str]) -> None:
        raise NotImplementedError

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stops, free finished requests; one output per touched request."""
        outputs, self._pending_outputs = self._pending_outputs, []
        sampled, requests, hints = runner_output.sampled_token_ids, self.requests, self._stop_hints
        if scheduler_output.scheduled_spec_decode_tokens or runner_output.spec_token_ids:
            self._update_drafts(scheduler_output, runner_output)
        plain = not runner_output.logprobs
        running = RequestStatus.RUNNING
        append = outputs.append
        any_finished = False
        get = sampled.get
        for request_id in scheduler_output.num_scheduled_tokens:
            token_ids = get(request_id)
            request = requests.get(request_id)
            if not token_ids or request is None or request.status is not running:
                continue
            out_ids, n_prompt = request.output_token_ids, len(request.prompt_token_ids)
            if plain and len(token_ids) == 1 and request.structured is None:
                # The decode fast path: one token that cannot stop the request and no logprobs.
                stop_ids, max_out = hints[request_id]
                token_id = token_ids[0]
                n_out = len(out_ids)
                if (
                    token_id not in stop_ids
                    and n_out + 1 < max_out
                    and request.num_computed_tokens >= n_prompt + n_out
                ):
                    out_ids.append(token_id)
                    cached = request.num_cached_tokens or 0
                    append(EngineCoreOutput(request_id, token_ids, None, None, None, n_prompt, cached))
                    continue
            output = self._append_tokens(request, token_ids, runner_output)
            append(output)
            if output.finish_reason is not None:
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.status is running]
        return outputs

    def _update_drafts(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Roll back the rejected drafts' positions (only accepted tokens count as computed, so only they
        are ever hashed into the prefix cache), count the drafts, and keep the next step's drafts."""
        running = RequestStatus.RUNNING
        for request_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            request = self.requests.get(request_id)
            token_ids = runner_output.sampled_token_ids.get(request_id)
            if request is None or request.status is not running or not token_ids:
                continue
            request.num_computed_tokens -= len(drafts) + 1 - len(token_ids)
            self.spec_counter.record(len(drafts), len(token_ids) - 1)
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is not None:
                request.spec_token_ids = runner_output.spec_token_ids.get(request_id, [])

    def _append_tokens(
        self, request: Request, token_ids: list[int], runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput:
        out_ids = request.output_token_ids
        if request.num_computed_tokens < len(request.prompt_token_ids) + len(out_ids):
            raise ValueError(
                f"the runner sampled for {request.request_id!r} before its prompt was fully computed"
            )
        stop_ids, max_out = self._stop_hints[request.request_id]
        status = None
        num_new = 0
        for token_id in token_ids:
            out_ids.append(token_id)
            num_new += 1
            # Most tokens stop nothing: only a possible stop id or a length limit needs the full check.
            # A completed grammar is a natural stop: it wins over a length limit hit by the same token.
            if request.structured is not None and request.structured.accept(token_id):
                if request.structured.error is None:
                    status = RequestStatus.FINISHED_STOPPED
                else:  # a token the grammar refused (or EOS where it does not accept): not an answer
                    status = RequestStatus.FINISHED_ERROR
                    request.stop_reason = request.structured.error
                break
            if token_id in stop_ids or len(out_ids) >= max_out:
                status = check_stop(request, self.max_model_len)
                if status is not None:
                    break
        logprobs = runner_output.logprobs.get(request.request_id) if runner_output.logprobs else None
        output = EngineCoreOutput(
            request.request_id,
            token_ids[:num_new] if num_new < len(token_ids) else token_ids,
            logprobs[:num_new] if logprobs is not None else None,
            None,
            None,
            len(request.prompt_token_ids),
            request.num_cached_tokens or 0,
        )
        if status is not None:
            request.status = status
            self._free_request(request)
            output.finish_reason = status.finish_reason
            output.stop_reason = request.stop_reason
        return output

    def _free_request(self, request: Request) -> None:
        self.kv.free(request)
        del self.requests[request.request_id]
        del self._stop_hints[request.request_id]
        self._finished_ids.add(request.request_id)

    def _apply_pending_finishes(self) -> None:
        if not self._pending_finish:
            return
        pending, self._pending_finish = self._pending_finish, {}
        ids = set(pending)
        self.running = [r for r in self.running if r.request_id not in ids]
        self._remove_waiting(ids)
        for request_id, status in pending.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            request.status = status
            self._free_request(request)
            if status is RequestStatus.FINISHED_ABORTED:
                self._pending_outputs.append(
                    EngineCoreOutput(
                        request_id=request_id,
                        new_token_ids=[],
                        finish_reason=status.finish_reason,
                        num_prompt_tokens=request.num_prompt_tokens,
                        num_cached_tokens=request.num_cached_tokens or 0,
                    )
                )
