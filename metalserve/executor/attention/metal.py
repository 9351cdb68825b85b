"""The kernel backend (`--attention-backend metal`): the contract's slot-major pools `[num_slots, Hkv, D]`
(metalserve/executor/attention/reference.py) attended by a function with the contract's signature: the Metal
kernel, or in tests its CPU emulation or the MLX reference."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from metalserve.executor.attention.base import AttentionBackend, AttentionCall, LayerCacheSpec
from metalserve.executor.attention.reference import paged_attention, write_kv
from metalserve.executor.step_inputs import StepInputs
from metalserve.kernels.metal.guard import LaunchRefused

logger = logging.getLogger("metalserve.engine")

# A function with the contract of metalserve.executor.attention.reference.paged_attention.
KernelFn = Callable[..., mx.array]


@dataclass
class LayerKV:
    """One layer's K and V pools, `[num_slots, Hkv, D]` each; each step's scatter replaces them with its
    outputs, which reuse the same buffers."""

    k: mx.array
    v: mx.array

    def arrays(self) -> list[mx.array]:
        return [self.k, self.v]


@dataclass(frozen=True)
class KernelStep:
    """The contract's per-step arrays."""

    block_tables: mx.array  # [R, width] int32
    cu_seqlens_q: mx.array  # [R + 1] int32
    seq_lens: mx.array  # [R] int32
    block_size: int


def _zeros(spec: LayerCacheSpec) -> mx.array:
    return mx.zeros((spec.num_slots, spec.num_kv_heads, spec.head_dim), spec.dtype)


class KernelAttention(AttentionBackend[LayerKV, KernelStep]):
    def __init__(
        self, kernel: KernelFn, name: str = "metal", description: str = "Metal paged-attention kernel"
    ) -> None:
        self.kernel = kernel
        self.name = name
        self.description = description
        self.warned = False  # a refused launch was reported (guard.py)

    def allocate(self, spec: LayerCacheSpec) -> LayerKV:
        if spec.value_dim is not None:  # select.py never picks this backend for such a model
            raise ValueError(f"the {self.name} kernel has no MLA latent layout (K and V must be pools of their own)")
        cache = LayerKV(_zeros(spec), _zeros(spec))
        mx.eval(cache.k, cache.v)
        return cache

    def extend(self, cache: LayerKV, spec: LayerCacheSpec) -> LayerKV:
        return LayerKV(mx.concatenate([cache.k, _zeros(spec)]), mx.concatenate([cache.v, _zeros(spec)]))

    def build_metadata(self, step: StepInputs, spec: LayerCacheSpec) -> KernelStep:
        return KernelStep(
            mx.array(step.padded_block_tables()), mx.array(step.cu_seqlens_q), mx.array(step.seq_lens), spec.block_size
        )

    def forward(self, call: AttentionCall[LayerKV, KernelStep]) -> mx.array:
        cache, meta = call.cache, call.meta
        if call.v is None:
            raise ValueError(f"the {self.name} kernel needs V of its own (MLA's latent layout is not supported)")
        cache.k, cache.v = write_kv(cache.k, cache.v, call.k, call.v, call.slot_mapping)
        try:
            return _attend(self.kernel, call, cache, meta)
        except LaunchRefused as refused:  # the device runs no launch of this shape: MLX ops, same contract
            if refused.first and not self.warned:
                self.warned = True
                logger.warning("%s; MLX ops run the attention the GPU refuses (this is said once)", refused)
            return _attend(paged_attention, call, cache, meta)


def _attend(fn: KernelFn, call: AttentionCall[LayerKV, KernelStep], cache: LayerKV, meta: KernelStep) -> mx.array:
    opts = call.options
    return fn(
        call.q,
        cache.k,
        cache.v,
        meta.block_tables,
        meta.cu_seqlens_q,
        meta.seq_lens,
        block_size=meta.block_size,
        scale=opts.scale,
        sliding_window=opts.sliding_window,
        softcap=opts.softcap,
        sinks=opts.sinks,
    )


def metal_attention() -> KernelAttention:
    """The Metal kernel (kernels/metal/gpu.py); only where the Platform has Metal."""
    from metalserve.kernels.metal.gpu import metal_paged_attention

    return KernelAttention(metal_paged_attention)
