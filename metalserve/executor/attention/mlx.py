"""The `mlx` backend (`--attention-backend mlx`): the seam (base.py) over the ops in mlx_ops.py. It keeps
the pool `[2, Hkv, num_slots, D]`, attended with MLX's fused attention per decode bucket and prefill
chunk. It runs
wherever MLX runs, in any dtype, and keeps quantized pages (int8, q4: kv_quant.py) where the spec says so."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from metalserve.executor.attention.base import AttentionBackend, AttentionCall, LayerCacheSpec
from metalserve.executor.attention.kv_quant import KVPool, QuantPool, SplitPool, quant_zeros
from metalserve.executor.attention.mlx_ops import (
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

    pool: KVPool

    def arrays(self) -> list[mx.array]:
        return self.pool.arrays() if isinstance(self.pool, QuantPool | SplitPool) else [self.pool]


def zeros_pool(spec: LayerCacheSpec) -> mx.array:
    """`[2, Hkv, num_slots, D]`, or `[1, ...]` for the latent layout (`spec.value_dim`: K alone)."""
    return mx.zeros((spec.num_planes, spec.num_kv_heads, spec.num_slots, spec.head_dim), spec.dtype)


class MlxAttention(AttentionBackend[PortableKV, AttentionPlan]):
    name = "mlx"
    description = "MLX ops (metalserve/executor/attention/mlx_ops.py)"

    def allocate(self, spec: LayerCacheSpec) -> PortableKV:
        cache = PortableKV(_zeros(spec))
        mx.eval(cache.arrays())
        return cache

    def extend(self, cache: PortableKV, spec: LayerCacheSpec) -> PortableKV:
        more = _zeros(spec)
        if isinstance(cache.pool, QuantPool) and isinstance(more, QuantPool):
            return PortableKV(cache.pool.concatenate(more))
        if isinstance(cache.pool, SplitPool) and isinstance(more, SplitPool):
            return PortableKV(cache.pool.concatenate(more))
        assert isinstance(cache.pool, mx.array) and isinstance(more, mx.array)
        return PortableKV(mx.concatenate([cache.pool, more], axis=2))

    def truncate(self, cache: PortableKV, spec: LayerCacheSpec) -> PortableKV:
        if isinstance(cache.pool, QuantPool | SplitPool):
            return PortableKV(cache.pool.truncate(spec.num_slots))
        return PortableKV(mx.contiguous(cache.pool[:, :, : spec.num_slots]))  # a copy: a slice would keep the buffer

    def build_metadata(self, step: StepInputs, spec: LayerCacheSpec) -> AttentionPlan:
        return build_plan(
            step.block_rows,
            step.cu_seqlens_q,
            step.seq_lens,
            spec.block_size,
            sliding_window=spec.sliding_window,
            num_kv_heads=spec.num_kv_heads,
            image_spans=step.image_spans,
        )

    def forward(self, call: AttentionCall[PortableKV, AttentionPlan]) -> mx.array:
        cache = call.cache
        if isinstance(cache.pool, QuantPool | SplitPool):
            cache.pool.write(mx.stack([call.k] if call.v is None else [call.k, call.v]), call.slot_mapping)
        else:
            cache.pool = write_kv_portable(cache.pool, call.k, call.v, call.slot_mapping)
        return paged_attention_planned(call.q, cache.pool, call.meta, call.options)


def _zeros(spec: LayerCacheSpec) -> KVPool:
    """A float pool in the model's dtype, or codes and scales where the spec's pages are quantized."""
    if spec.page.quantized:
        return quant_zeros(spec.num_planes, spec.num_kv_heads, spec.num_slots, spec.head_dim, spec.page, spec.dtype)
    return zeros_pool(spec)
