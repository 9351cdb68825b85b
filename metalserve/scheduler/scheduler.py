"""The V1 token-budget scheduler: one rule, `num_computed_tokens` catches up to `num_tokens`.

Each step spends one token budget: running requests first (in order), then waiting ones in policy
order while budget, `max_num_seqs` and KV blocks last. A prompt longer than the remaining budget
is cut to it (chunked prefill). When a running request cannot grow, the lowest-priority /
latest-arrived running request is preempted by recompute and put back at the head of the queue.
After the runner's step, `update_from_output` appends the sampled tokens, checks stops, rolls back
rejected drafts and frees what finished.

With `lookahead` (async scheduling, engine/core.py) the next step is scheduled before this one's tokens
are known: a request whose sampled token is still on its way gets one placeholder token (the runner
fills it in when the token arrives), unless that token is already its last. A request that then stops
on the token wasted one token of work; one preempted meanwhile still keeps the token it was owed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from metalserve.config import ConfigError, EngineConfig, SchedulingPolicy
from metalserve.kvcache.block_pool import NUM_RESERVED_BLOCKS
from metalserve.kvcache.connector.base import KVConnectorScheduler
from metalserve.kvcache.manager import BlockIds, KVCacheManager
from metalserve.kvcache.specs import LayerGroupSpec
from metalserve.outputs import EngineCoreOutput
from metalserve.request import Request, RequestStatus
from metalserve.scheduler.encoder_cache import EncoderCacheManager, EncoderPlan
from metalserve.scheduler.grammar_wait import grammar_verdict
from metalserve.scheduler.kv_loading import KVLoads
from metalserve.scheduler.output import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from metalserve.scheduler.queues import make_queue
from metalserve.scheduler.results import (
    StopHint,
    add_prompt_logprobs,
    append_sampled,
    output_of,
    record,
    stop_hint,
    update_drafts,
)
from metalserve.scheduler.stats import SchedulerStats, StatsCounter
from metalserve.scheduler.step import StepBuilder
from metalserve.spec_decode.stats import SpecDecodingCounter

__all__ = ["Scheduler", "SchedulerStats"]


class Scheduler:
    """Token-budget continuous batching over a paged KV cache; see the module docstring.

    Call `update_from_output` after every `schedule()`, also for an empty step: that is where aborted
    requests' outputs are delivered.
    """

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        initial_blocks: int | None = None,
        kv_groups: list[LayerGroupSpec] | None = None,
        mm_splittable: bool = True,
    ) -> None:
        """`initial_blocks`: start the KV pool this small and grow it on demand (None: all at once).
        `kv_groups`: the model's layer groups (None: one full-attention group). `mm_splittable`: whether
        a prefill chunk may end inside an image's placeholder tokens (scheduler/encoder_cache.py)."""
        caching = config.enable_prefix_caching
        self.kv = KVCacheManager(num_blocks, config.block_size, caching, initial_blocks, groups=kv_groups)
        needed = self.kv.blocks_for_request(max_model_len) + NUM_RESERVED_BLOCKS
        if num_blocks < needed:
            raise ConfigError(
                f"{num_blocks} KV blocks cannot hold one request of {max_model_len} tokens "
                f"({needed} blocks needed): raise --kv-cache-memory or lower --max-model-len"
            )
        self.config = config
        self.max_model_len = max_model_len
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_size)
        self.encoder = EncoderPlan(self.encoder_cache, mm_splittable)
        self._align = self.kv.align_chunks
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._stats = StatsCounter()
        self.spec_counter = SpecDecodingCounter()
        self._finished_ids: set[str] = set()
        self._pending_finish: dict[str, RequestStatus] = {}
        self._pending_outputs: list[EngineCoreOutput] = []
        self._stop_hints: dict[str, StopHint] = {}
        self.num_waiting_for_grammar = 0  # skipped by the last schedule(): their grammars still compile
        self.lookahead = False  # async scheduling: placeholders for tokens not sampled yet (see above)
        self.num_placeholders = 0  # tokens scheduled before their input was sampled (lookahead)
        self.kv_loads: KVLoads | None = None  # a KV connector's loads (set_connector)
        # An encoder's (bidirectional attention, no KV kept): a prompt is scheduled whole or waits.
        self.whole_prompts = False
        if config.scheduling_policy == SchedulingPolicy.PRIORITY:
            self._victim_key = lambda r: (r.priority, r.arrival_time)
        else:
            self._victim_key = lambda r: (0, r.arrival_time)

    def set_connector(self, connector: KVConnectorScheduler) -> None:
        """Attach a KV connector's scheduler half (kvcache/connector/): external prefix hits and saves.
        ValueError: the connector was built for other layer groups than this KV manager's."""
        connector.check_groups(self.kv.specs)
        self.kv_loads = KVLoads(connector, self.kv, self.config.block_size)

    @property
    def num_waiting_for_kv(self) -> int:
        """Requests parked while a connector loads their blocks (or frees them after an abort)."""
        return self.kv_loads.num_parked if self.kv_loads is not None else 0

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        for mm in request.mm_inputs:
            if mm.length > min(self.config.max_num_encoder_input_tokens, self.config.encoder_cache_size):
                raise ValueError(
                    f"an image of {mm.length} tokens is larger than the encoder budget "
                    f"(--max-num-encoder-input-tokens {self.config.max_num_encoder_input_tokens}, "
                    f"--encoder-cache-size {self.config.encoder_cache_size})"
                )
        self.kv.hash_prompt(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._stop_hints[request.request_id] = stop_hint(request, self.max_model_len)
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort at the next step boundary; each gets an output with finish_reason "abort"."""
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str] | str, status: RequestStatus) -> None:
        """Finish requests for reasons found outside (stop strings); applied at the next step boundary."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            if request_id in self.requests:
                self._pending_finish.setdefault(request_id, status)

    def has_unfinished_requests(self) -> bool:
        loads = self.kv_loads is not None and self.kv_loads.busy
        return bool(self.requests) or bool(self._pending_outputs) or loads

    def make_stats(self) -> SchedulerStats:
        """Counts now, cumulative counters, and the counters' deltas since the previous call."""
        kv, spec = self.kv, self.spec_counter
        stats = self._stats.snapshot(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + (len(self.kv_loads.loading) if self.kv_loads is not None else 0),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.pool.num_usable_blocks,
            counters=(kv.prefix_cache_queries, kv.prefix_cache_hits, self.num_preemptions),
        )
        if self.kv_loads is not None:
            stats = replace(stats, connector=self.kv_loads.connector.stats())
        if not spec.num_drafts:
            return stats
        return replace(
            stats,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=tuple(spec.accepted_per_pos),
        )

    # ---- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._apply_pending_finishes()
        step = StepBuilder(
            budget=self.config.max_num_batched_tokens, encoder_budget=self.config.max_num_encoder_input_tokens
        )
        self._schedule_running(step)
        # After a preemption the pool is tight: admitting new work would only thrash.
        if not step.preempted:
            self._schedule_waiting(step)
        return self._make_output(step)

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int, step: StepBuilder) -> int:
        n = self._num_text_tokens(request, num_computed, budget)
        if request.mm_inputs and num_computed < request.num_prompt_tokens and n > 0:
            n, to_encode = self.encoder.plan(request.mm_inputs, num_computed, n, step.encoder_budget)
            if n > 0 and to_encode:
                step.encoder_inputs[request.request_id] = to_encode
                step.encoder_budget -= sum(request.mm_inputs[i].length for i in to_encode)
        return n

    def _num_text_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        n = request.num_tokens - num_computed
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < n:
            n = threshold
        n = min(n, budget, self.max_model_len - num_computed)
        end, bs = num_computed + n, self.config.block_size
        if self._align and end < request.num_tokens and end // bs * bs > num_computed:
            n = end // bs * bs - num_computed  # recurrent states land on block boundaries: snapshots
        if self.whole_prompts and num_computed + n < request.num_tokens:
            return 0
        return n

    def _schedule_running(self, step: StepBuilder) -> None:
        running, kv, fast_limit = self.running, self.kv, self.kv.fast_limit
        num_tokens, cached_reqs = step.num_tokens, step.cached_reqs
        budget = step.budget  # a local in the 256-request decode loop; synced around preemption
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            rid, computed = request.request_id, request.num_computed_tokens
            n = len(request.prompt_token_ids) + len(request.output_token_ids) - computed
            k = 0  # draft tokens verified after the decode token
            # A decode token (n == 1) is always within the budget, the threshold and the context.
            if n == 0 and self._placeholder_fits(request):
                n = 1  # the token being sampled now is this step's input (a placeholder until it arrives)
                self.num_placeholders += 1
            elif n != 1:
                n = self._num_new_tokens(request, computed, budget, step)
                if n <= 0:  # its last token was scheduled but not yet sampled
                    i += 1
                    continue
            elif request.spec_token_ids:
                k = self._num_drafts(request, budget)
                n += k
            if computed + n <= fast_limit.get(rid, 0):
                # The inlined allocate_slots fast path: nothing to allocate in any group.
                cached_reqs.append(CachedRequestData(rid, kv.empty_block_ids(), computed))
            else:
                maybe_ids = kv.allocate_slots(request, n)
                if maybe_ids is None and k:  # no room for the drafts: decode without them first
                    n, k = 1, 0
                    maybe_ids = kv.allocate_slots(request, n)
                if maybe_ids is None:
                    step.budget = budget
                    maybe_ids, i = self._preempt_until_fits(request, n, i, step)
                    budget = step.budget
                    if maybe_ids is None:
                        step.undo_encoder(request)
                        continue  # it preempted itself; running[i] is now the next request
                cached_reqs.append(CachedRequestData(rid, maybe_ids, computed))
            if k:
                step.spec_tokens[rid] = request.spec_token_ids[:k]
            if request.mm_inputs and computed < request.num_prompt_tokens:
                self.encoder.commit(rid, request.mm_inputs, computed, computed + n)
            num_tokens[rid] = n
            budget -= n
            request.num_computed_tokens = computed + n
            i += 1
        step.budget = budget

    def _placeholder_fits(self, request: Request) -> bool:
        """Lookahead: a request past its prompt whose pending token may not be its last output."""
        return (
            self.lookahead
            and request.num_computed_tokens >= len(request.prompt_token_ids)
            and len(request.output_token_ids) + 1 < self._stop_hints[request.request_id].max_output_tokens
        )

    def _num_drafts(self, request: Request, budget: int) -> int:
        """How many of the request's drafts fit the budget and its output limit (max_tokens or the
        context, whichever comes first); the window's last token is one more output."""
        max_out = self._stop_hints[request.request_id].max_output_tokens
        room = min(budget - 1, max_out - request.num_output_tokens - 1)
        return max(0, min(len(request.spec_token_ids), room))

    def _preempt_until_fits(self, request: Request, n: int, i: int, step: StepBuilder) -> tuple[BlockIds | None, int]:
        """Preempt victims until `request` (at running[i]) fits; returns its new block ids and new i."""
        while True:
            victim = max(self.running, key=self._victim_key)
            if self.running.index(victim) < i:
                i -= 1
            self._preempt(victim, step)
            if victim is request:
                return None, i
            new_ids = self.kv.allocate_slots(request, n)
            if new_ids is not None:
                return new_ids, i

    def _preempt(self, request: Request, step: StepBuilder) -> None:
        self.running.remove(request)
        step.undo(request)
        self.kv.free(request)
        self.encoder_cache.release_all(request.request_id, request.mm_inputs)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        step.preempted.add(request.request_id)

    def _schedule_waiting(self, step: StepBuilder) -> None:
        skipped: list[Request] = []  # grammars still compiling: they wait without holding the queue
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.structured is not None and not self._grammar_ready(request, skipped):
                continue
            loads = self.kv_loads
            if loads is not None and request.request_id in loads.loaded:
                # Its blocks arrived from the connector: it holds them, and starts after the last one.
                hit_tokens = request.num_computed_tokens
                n = self._num_new_tokens(request, hit_tokens, step.budget, step)
                if n <= 0 or self.kv.allocate_slots(request, n) is None:
                    step.undo_encoder(request)
                    loads.release_loaded(self.waiting)
                    break
                loads.loaded.discard(request.request_id)
            else:
                hit = self.kv.get_computed_blocks(request)
                # Images too: their content hashes are in the chain hashes that key the connector's blocks.
                if loads is not None and loads.start_loading(request, hit):
                    self.waiting.pop()  # parked outside the queue while its blocks load
                    continue
                n = self._num_new_tokens(request, hit.num_tokens, step.budget, step)
                new_ids = self.kv.allocate_slots(request, n, hit) if n > 0 else None
                if new_ids is None:
                    # Admission control: it waits at the head (nothing is dropped) until blocks free up.
                    step.undo_encoder(request)
                    if loads is not None:
                        loads.release_loaded(self.waiting)
                    break
                hit_tokens = hit.num_tokens
            if request.mm_inputs:
                self.encoder.commit(request.request_id, request.mm_inputs, hit_tokens, hit_tokens + n)
            request.num_computed_tokens = hit_tokens
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit_tokens
            step.add_new(request, n, self.kv.get_block_ids(request.request_id))
        for request in reversed(skipped):
            self.waiting.prepend(request)
        self.num_waiting_for_grammar = len(skipped)

    def _grammar_ready(self, request: Request, skipped: list[Request]) -> bool:
        """Whether the head request's grammar can be used; pops it (to skip or to fail) when not."""
        verdict = grammar_verdict(request)
        if verdict == "ready":
            return True
        self.waiting.pop()
        if verdict == "compiling":
            skipped.append(request)
        else:  # a compile error (the API validates first, so only direct engine callers get here)
            self.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
        return False

    def _make_output(self, step: StepBuilder) -> SchedulerOutput:
        finished, self._finished_ids = self._finished_ids, set()
        meta = self.kv_loads.metadata(step.num_tokens, self.requests) if self.kv_loads is not None else None
        return SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_tokens,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - step.budget,
            finished_req_ids=finished,
            preempted_req_ids=step.preempted,
            num_kv_blocks=self.kv.pool.num_allocated_blocks,
            scheduled_spec_decode_tokens=step.spec_tokens,
            kv_connector_metadata=meta if meta is not None and not meta.is_empty else None,
            scheduled_encoder_inputs=step.encoder_inputs,
            free_encoder_mm_hashes=self.encoder_cache.take_freed(),
        )

    # ---- the step's results ----------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stops, free finished requests; one output per touched request."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.kv_loads is not None and runner_output.kv_connector_output is not None:
            self.kv_loads.finish(runner_output.kv_connector_output, self.waiting.prepend)
        sampled, requests, hints = runner_output.sampled_token_ids, self.requests, self._stop_hints
        max_model_len = self.max_model_len
        if scheduler_output.scheduled_spec_decode_tokens or runner_output.spec_token_ids:
            update_drafts(self.requests, self.spec_counter, scheduler_output, runner_output)
        if runner_output.prompt_logprobs:
            add_prompt_logprobs(self.requests, runner_output)
        plain = not runner_output.logprobs
        running = RequestStatus.RUNNING
        append = outputs.append
        # Pooling requests end with their prompt: they sample nothing (they are not in `sampled`).
        any_finished = self._finish_pooled(runner_output.pooled, outputs) if runner_output.pooled else False
        get = sampled.get
        if self.encoder_cache.in_use:  # only a step of an image's request has any to release
            self._release_encoded(scheduler_output)
        for request_id in scheduler_output.num_scheduled_tokens:
            token_ids = get(request_id)
            request = requests.get(request_id)
            if not token_ids or request is None:
                continue
            if request.status is not running:
                if request.status is RequestStatus.PREEMPTED:  # by a lookahead schedule(), after sampling
                    append(self._append_preempted(request, token_ids, runner_output))
                continue
            n_prompt = len(request.prompt_token_ids)
            if (
                plain
                and len(token_ids) == 1
                and request.prompt_logprobs is None
                and request.num_computed_tokens >= n_prompt + len(request.output_token_ids)
            ):
                # The decode fast path: one token and no logprobs, so its output record is built here.
                _, status = append_sampled(request, token_ids, hints[request_id], max_model_len)
                output = record(request, token_ids)
                if status is not None:
                    self._finish(request, status, output)
            else:
                output = self._append_tokens(request, token_ids, runner_output)
            append(output)
            if output.finish_reason is not None:
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.status is running]
        return outputs

    def _finish_pooled(self, pooled: dict[str, list[float]], outputs: list[EngineCoreOutput]) -> bool:
        """Pooling requests end with their prompt: one output with the vector, and their blocks go back
        (full ones stay in the prefix cache). A request finished meanwhile (an abort) is skipped."""
        any_finished = False
        for request_id, vector in pooled.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            output = record(request, [], pooled=vector)
            self._finish(request, RequestStatus.FINISHED_STOPPED, output)
            outputs.append(output)
            any_finished = True
        return any_finished

    def _release_encoded(self, scheduler_output: SchedulerOutput) -> None:
        """Images whose placeholder tokens this step computed in full need their encoder output no more."""
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is not None and request.mm_inputs:
                self.encoder.release_done(request_id, request.mm_inputs, request.num_computed_tokens)

    def _append_tokens(
        self, request: Request, token_ids: list[int], runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput:
        if request.num_computed_tokens < len(request.prompt_token_ids) + len(request.output_token_ids):
            raise ValueError(f"the runner sampled for {request.request_id!r} before its prompt was fully computed")
        hint = self._stop_hints[request.request_id]
        num_new, status = append_sampled(request, token_ids, hint, self.max_model_len)
        output = output_of(request, token_ids, num_new, runner_output)
        if request.prompt_logprobs is not None:  # the first output: the prompt is computed whole by now
            output.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
        if status is not None:
            self._finish(request, status, output)
        return output

    def _append_preempted(
        self, request: Request, token_ids: list[int], runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput:
        """The token a request was sampled before a lookahead schedule() preempted it: it is kept (it
        was computed from the whole context), and the request recomputes with it when it resumes."""
        hint = self._stop_hints[request.request_id]
        num_new, status = append_sampled(request, token_ids, hint, self.max_model_len)
        output = output_of(request, token_ids, num_new, runner_output)
        if status is not None:
            self.waiting.remove({request.request_id})
            self._finish(request, status, output)
        return output

    def _finish(self, request: Request, status: RequestStatus, output: EngineCoreOutput) -> None:
        request.status = status
        self._free_request(request)
        output.finish_reason = status.finish_reason
        output.stop_reason = request.stop_reason

    def _free_request(self, request: Request) -> None:
        if self.kv_loads is None or not self.kv_loads.finished_while_loading(request):
            self.kv.free(request)
        self.encoder_cache.release_all(request.request_id, request.mm_inputs)
        del self.requests[request.request_id]
        del self._stop_hints[request.request_id]
        self._finished_ids.add(request.request_id)

    def _apply_pending_finishes(self) -> None:
        if not self._pending_finish:
            return
        pending, self._pending_finish = self._pending_finish, {}
        ids = set(pending)
        self.running = [r for r in self.running if r.request_id not in ids]
        self.waiting.remove(ids)
        for request_id, status in pending.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            request.status = status
            self._free_request(request)
            if status is RequestStatus.FINISHED_ABORTED:
                self._pending_outputs.append(record(request, [], finish_reason=status.finish_reason))
