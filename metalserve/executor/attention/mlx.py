"""The MLX-ops backend (`--attention-backend mlx`): the pool `[2, Hkv, num_slots, D]`, attended with
MLX's fused attention per decode bucket and prefill chunk (metalserve/executor/attention/reference.py). It runs
wherever MLX runs, in any dtype."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from metalserve.executor.attention.base import AttentionBackend, AttentionCall, LayerCacheSpec
from metalserve.executor.attention.reference import (
    AttentionPlan,
    build_plan,
    paged_attention_planned,
    write_kv_portable,
)
from metalserve.executor.step_inputs import StepInputs


@dataclass
class PortableKV:
    """One layer's K and V in one array `[2, Hkv, num_slots, D]`; each step's scatter replaces `pool`
    with its output, which reuses the same buffer."""

    pool: mx.array

    def arrays(self) -> list[mx.array]:
        return [self.pool]


def zeros_pool(spec: LayerCacheSpec) -> mx.array:
    """`[2, Hkv, num_slots, D]`, or `[1, ...]` for the latent layout (`spec.value_dim`: K alone)."""
    return mx.zeros((spec.num_planes, spec.num_kv_heads, spec.num_slots, spec.head_dim), spec.dtype)


class MlxAttention(AttentionBackend[PortableKV, AttentionPlan]):
    name = "mlx"
    description = "MLX ops (metalserve/executor/attention/reference.py)"

    def allocate(self, spec: LayerCacheSpec) -> PortableKV:
        pool = zeros_pool(spec)
        mx.eval(pool)
        return PortableKV(pool)

    def extend(self, cache: PortableKV, spec: LayerCacheSpec) -> PortableKV:
        return PortableKV(mx.concatenate([cache.pool, zeros_pool(spec)], axis=2))

    def build_metadata(self, step: StepInputs, spec: LayerCacheSpec) -> AttentionPlan:
        return build_plan(step.block_rows, step.cu_seqlens_q, step.seq_lens, spec.block_size,
                          sliding_window=spec.sliding_window, num_kv_heads=spec.num_kv_heads)  # fmt: skip

    def forward(self, call: AttentionCall[PortableKV, AttentionPlan]) -> mx.array:
        cache = call.cache
        cache.pool = write_kv_portable(cache.pool, call.k, call.v, call.slot_mapping)
        return paged_attention_planned(call.q, cache.pool, call.meta, call.options)
