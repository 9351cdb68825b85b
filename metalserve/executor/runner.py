"""The model runner: SchedulerOutput -> packed inputs -> one forward -> sampled tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx

from metalserve.executor.context import AttentionFn, ForwardContext, LayerKV, PortableKV, forward_context
from metalserve.executor.input_batch import CachedRequestState
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.step_inputs import StepInputs, pack_step
from metalserve.kernels.reference import build_plan
from metalserve.outputs import TokenLogprob
from metalserve.scheduler.output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from metalserve.loader import LoadedModel


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: mx.Dtype
    block_size: int
    num_blocks: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.size * self.block_size

    @classmethod
    def for_model(cls, loaded: LoadedModel, block_size: int, num_blocks: int) -> KVCacheSpec:
        return cls(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, loaded.dtype, block_size, num_blocks)


class SamplerFn(Protocol):
    def __call__(self, logits: mx.array, requests: Sequence[CachedRequestState]) -> SamplerResult: ...


class SamplerResult(Protocol):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class ModelRunner:
    """Keeps a persistent batch of request states and the paged KV pools; runs one mixed step at a time."""

    def __init__(
        self,
        model: PagedModel,
        spec: KVCacheSpec,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        sampler: SamplerFn | None = None,
        attention_fn: AttentionFn | None = None,
        cpu_attention: bool = False,
    ) -> None:
        """`attention_fn`: a kernel backend with the contract signature; None runs the portable path,
        attended by the numba CPU kernel instead when `cpu_attention` (float32 pools only)."""
        if cpu_attention and (attention_fn is not None or spec.dtype != mx.float32):
            raise ValueError(f"the CPU attention path needs the portable float32 pool (dtype {spec.dtype})")
        self.model = model
        self.spec = spec
        self.eos_token_ids = eos_token_ids
        self.attention_fn = attention_fn
        self.cpu_attention = cpu_attention
        if sampler is None:
            from metalserve.executor.sampler import Sampler

            sampler = Sampler()
        self.sampler = sampler
        self.kv = allocate_kv(spec, portable=attention_fn is None)
        self._attach_kv()
        self.requests: dict[str, CachedRequestState] = {}

    def _attach_kv(self) -> None:
        """Materialize the pools; the CPU path writes them through NumPy views of their buffers."""
        mx.eval(self._kv_arrays())
        if self.cpu_attention:
            from metalserve.kernels.cpu import host_view

            for layer in self.kv:
                assert isinstance(layer, PortableKV)
                layer.host = host_view(layer.pool)

    def grow_kv(self, num_blocks: int) -> None:
        """Extend every layer's pool to `num_blocks` blocks, keeping what the old blocks hold."""
        more = replace(self.spec, num_blocks=num_blocks - self.spec.num_blocks)
        extra = allocate_kv(more, portable=self.attention_fn is None)
        old_kv: list[LayerKV | PortableKV] = list(self.kv)
        self.kv = [old.extended(new) for old, new in zip(old_kv, extra, strict=True)]  # type: ignore[arg-type,assignment]
        self.spec = replace(self.spec, num_blocks=num_blocks)
        self._attach_kv()
        mx.clear_cache()  # the old, smaller buffers are not needed again

    def _kv_arrays(self) -> list[mx.array]:
        return [a for layer in self.kv for a in layer.arrays()]

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.request_id] = CachedRequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_ids=self.eos_token_ids,
                structured=new.structured,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            state.add_blocks(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _context(self, step: StepInputs) -> ForwardContext:
        common = dict(
            positions=mx.array(step.positions),
            slot_mapping=mx.array(step.slot_mapping),
            kv=self.kv,
            block_size=self.spec.block_size,
        )
        if self.cpu_attention:
            from metalserve.kernels.cpu import build_cpu_plan

            cpu = build_cpu_plan(
                step.padded_block_tables(), step.cu_seqlens_q, step.seq_lens, step.slot_mapping, self.spec.block_size
            )
            return ForwardContext(plan=None, cpu=cpu, **common)  # type: ignore[arg-type]
        if self.attention_fn is None:
            plan = build_plan(
                step.block_rows, step.cu_seqlens_q, step.seq_lens, self.spec.block_size,
                num_kv_heads=self.spec.num_kv_heads,
            )  # fmt: skip
            return ForwardContext(plan=plan, **common)  # type: ignore[arg-type]
        return ForwardContext(
            plan=None,
            block_tables=mx.array(step.padded_block_tables()),
            cu_seqlens_q=mx.array(step.cu_seqlens_q),
            seq_lens=mx.array(step.seq_lens),
            attention_fn=self.attention_fn,
            **common,  # type: ignore[arg-type]
        )

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.num_kv_blocks > self.spec.num_blocks:
            self.grow_kv(so.num_kv_blocks)
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(sampled_token_ids={})
        step = pack_step(self.requests, so.num_scheduled_tokens, self.spec.block_size)
        with forward_context(self._context(step)):
            logits = self.model(mx.array(step.token_ids), mx.array(step.logits_indices))
        sampling = [self.requests[step.request_ids[i]] for i in step.sampling_rows]
        result = self.sampler(logits, sampling) if sampling else _NO_SAMPLES
        # Evaluate the pools with the logits so the scatters run now and release the old buffers.
        mx.eval(self._kv_arrays())
        sampled: dict[str, list[int]] = {rid: [] for rid in step.request_ids}
        logprobs: dict[str, list[TokenLogprob]] = {}
        for rid in step.request_ids:
            self.requests[rid].num_computed_tokens += so.num_scheduled_tokens[rid]
        for j, state in enumerate(sampling):
            token = result.token_ids[j]
            state.token_ids.append(token)
            sampled[state.request_id] = [token]
            lp = result.logprobs[j]
            if lp is not None:
                logprobs[state.request_id] = [lp]
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def allocate_kv(spec: KVCacheSpec, *, portable: bool) -> list[LayerKV] | list[PortableKV]:
    """Zeroed pools in the attention backend's layout (see metalserve/kernels/reference.py)."""
    if portable:
        joint = (2, spec.num_kv_heads, spec.num_slots, spec.head_dim)
        return [PortableKV(mx.zeros(joint, spec.dtype)) for _ in range(spec.num_layers)]
    shape = (spec.num_slots, spec.num_kv_heads, spec.head_dim)
    return [LayerKV(mx.zeros(shape, spec.dtype), mx.zeros(shape, spec.dtype)) for _ in range(spec.num_layers)]


@dataclass
class _NoSamples:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


_NO_SAMPLES = _NoSamples([], [])
