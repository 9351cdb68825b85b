"""The model runner: SchedulerOutput -> packed inputs -> one forward -> sampled tokens."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from metalserve.executor.attention.base import AttentionBackend, LayerCacheSpec
from metalserve.executor.attention.mlx import MlxAttention
from metalserve.executor.block_table import BlockTables
from metalserve.executor.connector.base import KVConnectorWorker
from metalserve.executor.context import ForwardContext, GroupStep, forward_context
from metalserve.executor.encoders.cache import EncoderOutputs, RequestSpan, StepImages
from metalserve.executor.input_batch import CachedRequestState
from metalserve.executor.logprobs import prompt_logprobs
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.pooling import PoolingSoFar, pool_step
from metalserve.executor.state_cache import RecurrentStates
from metalserve.executor.step_inputs import StepInputs, pack_step
from metalserve.kvcache.specs import AttentionSpec, KVCacheSpec
from metalserve.lora.layers import LoraSlots, lora_step
from metalserve.multimodal.inputs import MultiModalInput
from metalserve.multimodal.mrope import mrope_positions, packed_mrope_positions
from metalserve.outputs import TokenLogprob
from metalserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from metalserve.spec_decode.controller import DraftController
from metalserve.spec_decode.proposer import Proposer
from metalserve.spec_decode.rollback import num_rejected
from metalserve.spec_decode.verify import Window, verify_windows


@dataclass(frozen=True)
class InFlightStep:
    """A launched step: its forward runs (or has run) while the engine thread does other work."""

    so: SchedulerOutput
    step: StepInputs | None  # None: nothing was scheduled
    started: float  # when the forward began (perf_counter), for the draft controller
    logits: mx.array | None  # the MLX forward's logits (lazy, being evaluated)
    host: Future[np.ndarray] | None  # the host forward's logits, from the forward thread
    pooled: dict[str, mx.array] | None = None  # pooling requests this step finished: their vectors (lazy)


class SamplerFn(Protocol):
    def __call__(self, logits: mx.array, requests: Sequence[CachedRequestState]) -> SamplerResult: ...


class SamplerResult(Protocol):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


MLX_OPS = MlxAttention()  # the default backend: it runs wherever MLX runs, and keeps no state


class ModelRunner:
    """Keeps a persistent batch of request states and the paged KV pools; runs one mixed step at a time."""

    shrinks_kv = True  # its pools can be cut back at idle (shrink_kv)

    def __init__(
        self,
        model: PagedModel,
        spec: KVCacheSpec,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        sampler: SamplerFn | None = None,
        backend: AttentionBackend[Any, Any] = MLX_OPS,
        proposer: Proposer | None = None,
        encoder: Callable[[MultiModalInput], mx.array] | None = None,
        mrope_merge_size: int | None = None,
        async_eval: bool = False,
    ) -> None:
        """`backend`: how attention runs (executor/attention/), chosen by the engine from the Platform;
        `proposer`: drafts for speculative decoding (spec_decode/), None: off; `encoder`: a
        vision-language model's tower, one image to its placeholder embeddings
        (executor/encoders/vision.py); `mrope_merge_size`: set for a
        model with multimodal RoPE (positions [3, T]), its vision patch merge; `async_eval`: overlapped
        steps run through `mx.async_eval` (the engine sets it on Metal only: on MLX's CPU backend, mlx
        0.32.4, evaluating quantized matmuls asynchronously and then sampling from them died with SIGFPE)."""
        self.model = model
        self.spec = spec
        self.eos_token_ids = eos_token_ids
        self.backend = backend
        if sampler is None:
            from metalserve.executor.sampler import Sampler

            sampler = Sampler()
        self.sampler = sampler
        self.kv: list[Any] = [self.backend.allocate(self._layer(t)) for t in spec.tensors]
        self.requests: dict[str, CachedRequestState] = {}
        # Every request's block ids in every layer group of the spec (attention and recurrent state).
        self.block_tables = BlockTables(spec.groups, spec.block_size)
        self.states: RecurrentStates | None = None
        if model.state_layout is not None:
            self.states = RecurrentStates(model.state_layout, self.block_tables, spec.num_blocks)
        self.proposer = proposer
        self.drafting = DraftController()  # how many drafts pay (spec_decode/controller.py)
        self._forward_pool: ThreadPoolExecutor | None = None
        self.async_eval = async_eval
        self.encoder_outputs = EncoderOutputs(encoder) if encoder is not None else None
        self.mrope_merge_size = mrope_merge_size
        self.connector: KVConnectorWorker | None = None  # a KV connector's worker half (the disk tier)
        self.lora: LoraSlots | None = None  # the loaded LoRA adapters (--enable-lora; serving/lora.py)
        # A pooling model (--runner pooling) takes pooling requests only; a generating one none.
        self.pooling_model = False
        self.pooling_so_far: dict[str, PoolingSoFar] = {}  # chunked pooling prompts (executor/pooling.py)

    def _layer(self, attn: AttentionSpec, num_blocks: int | None = None) -> LayerCacheSpec:
        """One pool tensor's (or group's) cache of the spec's pages, `num_blocks` blocks (default: all)."""
        return LayerCacheSpec(attn, self.spec.block_size, self.spec.num_blocks if num_blocks is None else num_blocks)

    def grow_kv(self, num_blocks: int) -> None:
        """Extend every pool tensor to `num_blocks` blocks, keeping what the old blocks hold."""
        more = num_blocks - self.spec.num_blocks
        # One pool tensor at a time, each old buffer freed before the next is copied: built lazily and
        # evaluated together, every old and every new tensor were alive at once (the resident set's peak
        # rose by the whole old pool, plus the zeros).
        for i, tensor in enumerate(self.spec.tensors):
            self.kv[i] = self.backend.extend(self.kv[i], self._layer(tensor, more))
            mx.eval(self.kv[i].arrays())
            mx.clear_cache()  # the old, smaller buffer is not needed again
        self.spec = self.spec.with_blocks(num_blocks)
        if self.states is not None:
            self.states.pool.grow(num_blocks)
        if self.proposer is not None:
            self.proposer.grow(num_blocks)
        mx.clear_cache()  # the states' old buffers (they and the draft's pool evaluate as they grow)

    def shrink_kv(self, num_blocks: int) -> None:
        """Cut every pool tensor back to its first `num_blocks` blocks (the KV manager gave the rest back at
        idle; none of them is in any table) and hand the freed buffers to the OS."""
        self.kv = [
            self.backend.truncate(c, self._layer(t, num_blocks))
            for c, t in zip(self.kv, self.spec.tensors, strict=True)
        ]
        self.spec = self.spec.with_blocks(num_blocks)
        if self.states is not None:
            self.states.pool.truncate(num_blocks)
        if self.proposer is not None:
            self.proposer.truncate(num_blocks)
        mx.eval(self._kv_arrays())
        mx.clear_cache()

    def _kv_arrays(self) -> list[mx.array]:
        states = self.states.pool.all_arrays() if self.states is not None else []
        return [a for layer in self.kv for a in layer.arrays()] + states

    def _update_states(self, so: SchedulerOutput) -> None:
        if self.encoder_outputs is not None:
            self.encoder_outputs.free(so.free_encoder_mm_hashes)
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(rid, None)
            self.block_tables.remove(rid)  # a preempted request comes back new, with a fresh state
            self.drafting.forget(rid)
            self.pooling_so_far.pop(rid, None)
            if self.proposer is not None:
                self.proposer.forget(rid)
        for new in so.scheduled_new_reqs:
            self.requests[new.request_id] = CachedRequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                blocks=self.block_tables.add_request(new.request_id, new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_ids=self.eos_token_ids,
                structured=new.structured,
                mm_inputs=new.mm_inputs,
                mrope=self._mrope_table(new.num_prompt_tokens, new.mm_inputs),
                lora_slot=self._lora_slot(new.lora.name) if new.lora is not None else -1,
                lora_scale=new.lora.scale if new.lora is not None else 1.0,
            )
        for cached in so.scheduled_cached_reqs:
            self.block_tables.append(cached.request_id, cached.new_block_ids)
            self.requests[cached.request_id].num_computed_tokens = cached.num_computed_tokens

    def _lora_slot(self, name: str) -> int:
        slot = self.lora.slots.get(name) if self.lora is not None else None
        if slot is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        return slot

    def _mrope_table(self, num_prompt_tokens: int, mm_inputs: list[MultiModalInput]) -> tuple[Any, int] | None:
        if not mm_inputs:
            return None
        if self.encoder_outputs is None:
            raise ValueError("a request with images for a model without a vision tower")
        if self.mrope_merge_size is None:
            return None
        return mrope_positions(num_prompt_tokens, mm_inputs, self.mrope_merge_size)

    def _positions(self, step: StepInputs) -> mx.array:
        """The step's positions: [T], or [3, T] for an M-RoPE model (multimodal/mrope.py)."""
        if self.mrope_merge_size is None:
            return mx.array(step.positions)
        states = [self.requests[rid] for rid in step.request_ids]
        counts = np.diff(step.cu_seqlens_q)
        starts = step.seq_lens - counts
        return mx.array(packed_mrope_positions([s.mrope for s in states], starts.tolist(), counts.tolist()))

    def _images(self, step: StepInputs) -> StepImages | None:
        """The vision tower's embeddings of the step's image tokens (encoding images not yet cached)."""
        if self.encoder_outputs is None:
            return None
        cu, ends = step.cu_seqlens_q, step.seq_lens
        spans = [
            RequestSpan(state.mm_inputs, int(ends[i] - (cu[i + 1] - cu[i])), int(ends[i]), int(cu[i]))
            for i, rid in enumerate(step.request_ids)
            if (state := self.requests[rid]).mm_inputs
        ]
        return self.encoder_outputs.gather(spans) if spans else None

    def _group_step(self, step: StepInputs, group: int) -> GroupStep:
        """The group's slots and metadata, built once per step and shared by the group's layers."""
        step = self.block_tables.group_step(step, group)
        attn = self.spec.groups[group]
        assert isinstance(attn, AttentionSpec)
        return GroupStep(mx.array(step.slot_mapping), self.backend.build_metadata(step, self._layer(attn)))

    def _context(self, step: StepInputs) -> ForwardContext:
        groups = [self._group_step(step, g) for g in self.block_tables.attention_groups]
        states = self.states.plan(step) if self.states is not None else None
        lora = None
        if self.lora is not None:
            reqs = [self.requests[r] for r in step.request_ids]
            lora = lora_step([r.lora_slot for r in reqs], [r.lora_scale for r in reqs], step.cu_seqlens_q)
        return ForwardContext(self._positions(step), self.backend, self.kv, groups, states, self._images(step), lora)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step, start to end."""
        return self.finish(self.launch(so, overlap=False))

    def launch(self, so: SchedulerOutput, overlap: bool = True) -> InFlightStep:
        """Apply the step's diffs, pack it and start its forward; `finish` waits for it and samples.

        `overlap`: let the forward run while this thread goes on (async scheduling): `mx.async_eval` on
        Metal, or, where the whole decoder runs in numba (which releases the GIL), on the forward thread;
        elsewhere the graph is built here and evaluated in `finish`. Sampling waits for `finish`, so it
        sees every token and grammar step that came before."""
        if so.num_kv_blocks > self.spec.num_blocks:
            self.grow_kv(so.num_kv_blocks)
        self._update_states(so)
        connector = self.connector
        if connector is not None:
            connector.start_load_kv(so.kv_connector_metadata, self.kv)
        if so.total_num_scheduled_tokens == 0:
            return InFlightStep(so, None, 0.0, None, None)
        drafts = so.scheduled_spec_decode_tokens
        step = pack_step(
            self.requests,
            so.num_scheduled_tokens,
            self.spec.block_size,
            drafts,
            bidirectional_images=self.model.family.bidirectional_images,
        )
        started = time.perf_counter()
        host: Future[np.ndarray] | None = None
        logits: mx.array | None = None
        pooled: dict[str, mx.array] | None = None
        with forward_context(self._context(step)):
            if step.pooling_rows:
                logits, pooled = self._forward_pooling(step)
                job = None
            else:
                job = self.model.host_job(step.token_ids, step.logits_indices) if overlap else None
                if job is None:
                    logits = self.model(step.token_ids, step.logits_indices)
        if job is not None:
            host = self._forward_thread().submit(job)
        elif overlap and self.async_eval:
            mx.async_eval(*(a for a in (logits, *(pooled or {}).values()) if a is not None), *self._kv_arrays())
        return InFlightStep(so, step, started, logits, host, pooled)

    def _forward_pooling(self, step: StepInputs) -> tuple[mx.array | None, dict[str, mx.array]]:
        """A step with pooling requests: every row's hidden state is kept (the pooled rows need theirs),
        and only the sampling rows are projected to the vocabulary. All MLX (a pooling model is built
        with MLX compute, serving/build.py)."""
        hidden = self.model.mlx_hidden_states(mx.array(step.token_ids))
        logits = self.model.mlx_logits(hidden[mx.array(step.logits_indices)]) if step.logits_indices.size else None
        pooled = pool_step(hidden, step, self.requests, self.pooling_so_far, self.model.mlx_logits)
        return logits, pooled

    def finish(self, flight: InFlightStep) -> ModelRunnerOutput:
        """Wait for the step's logits, sample, and advance each request's state."""
        so, step = flight.so, flight.step
        connector = self.connector
        if step is None:
            finished = connector.get_finished() if connector is not None else None
            return ModelRunnerOutput(sampled_token_ids={}, kv_connector_output=finished)
        logits = mx.array(flight.host.result()) if flight.host is not None else flight.logits
        drafts = so.scheduled_spec_decode_tokens
        sampling = [self.requests[step.request_ids[i]] for i in step.sampling_rows]
        prompt: dict[str, tuple[int, list[TokenLogprob]]] = {}
        windows: list[Window] = []
        if logits is not None:  # None: a step of pooling requests only
            prompt = (
                prompt_logprobs(logits[step.num_sampling_logits :], step, self.requests) if step.prompt_rows else {}
            )
            windows = self._sample(logits[: step.num_sampling_logits] if step.prompt_rows else logits, sampling, drafts)
        pooled = flight.pooled or {}
        # Evaluate the pools with the logits so the scatters run now and release the old buffers.
        partial = [a for acc in self.pooling_so_far.values() for a in (acc.total, acc.first) if a is not None]
        mx.eval(self._kv_arrays(), list(pooled.values()), partial)
        if connector is not None:  # the step's full blocks are computed now: copy them out
            connector.save_kv(so.kv_connector_metadata, self.kv)
        sampled: dict[str, list[int]] = {rid: [] for rid in step.request_ids}
        logprobs: dict[str, list[TokenLogprob]] = {}
        for rid in step.request_ids:
            self.requests[rid].num_computed_tokens += so.num_scheduled_tokens[rid]
        for state, window in zip(sampling, windows, strict=True):
            rid = state.request_id
            state.token_ids.extend(window.token_ids)
            sampled[rid] = window.token_ids
            if window.logprobs is not None:
                logprobs[rid] = window.logprobs
            num_drafted = len(drafts.get(rid, ()))
            if num_drafted:  # the rejected drafts' KV is stale: the next step overwrites it
                state.num_computed_tokens -= num_rejected(num_drafted, len(window.token_ids))
                self.drafting.record_window(rid, num_drafted, len(window.token_ids) - 1)
        spec: dict[str, list[int]] = {}
        if self.proposer:
            spec = self._propose(sampling, step, time.perf_counter() - flight.started, drafts)
        finished = connector.get_finished() if connector is not None else None
        return ModelRunnerOutput(
            sampled_token_ids=sampled,
            logprobs=logprobs,
            spec_token_ids=spec,
            kv_connector_output=finished,
            prompt_logprobs=prompt,
            pooled={rid: np.asarray(vector).tolist() for rid, vector in pooled.items()},
        )

    def _forward_thread(self) -> ThreadPoolExecutor:
        """The thread a host (numba) forward runs on while the engine thread prepares the next step; it
        touches NumPy only: the logits become an MLX array back on the engine thread."""
        if self._forward_pool is None:
            self._forward_pool = ThreadPoolExecutor(1, thread_name_prefix="metalserve-forward")
        return self._forward_pool

    def _propose(
        self, sampling: list[CachedRequestState], step: StepInputs, seconds: float, drafts: dict[str, list[int]]
    ) -> dict[str, list[int]]:
        """The next drafts, as many as pay in a decode step of these requests. (Measured against a step
        with a prefill chunk in it, every draft would look cheap beside the chunk's cost.)"""
        assert self.proposer is not None
        num_tokens = int(step.token_ids.size)
        without = num_tokens - sum(len(d) for d in drafts.values())
        if without == len(sampling) == len(step.request_ids):  # decode and draft tokens only
            self.drafting.record_step(num_tokens, seconds)
        limits = self.drafting.limits([s.request_id for s in sampling], len(sampling), self.proposer.k)
        started = time.perf_counter()
        proposed = self.proposer.propose(sampling, limits)
        self.drafting.record_proposal(max(map(len, proposed.values()), default=0), time.perf_counter() - started)
        return proposed

    def _sample(
        self, logits: mx.array, sampling: list[CachedRequestState], drafts: dict[str, list[int]]
    ) -> list[Window]:
        """One window per sampling request: its accepted drafts and the next token."""
        if not sampling:
            return []
        if drafts:
            spec = [drafts.get(s.request_id, []) for s in sampling]
            return verify_windows(self.sampler, logits, sampling, spec)
        result = self.sampler(logits, sampling)
        return [
            Window([token], None if lp is None else [lp])
            for token, lp in zip(result.token_ids, result.logprobs, strict=True)
        ]
