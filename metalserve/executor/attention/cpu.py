"""The CPU backend (`--attention-backend cpu`): the float32 pool `[2, Hkv, num_slots, D]`, written in
place through a NumPy view of its MLX buffer and attended by the numba kernel (metalserve/kernels/cpu/paged.py).
The backend owns those views: it makes them when it allocates a pool and again when a pool grows.
Quantized pages (int8, q4: kv_quant.QuantPool; k8v4: kv_quant.SplitPool) are written and read through
views of their arrays alike."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from metalserve.executor.attention.base import AttentionBackend, AttentionCall, LayerCacheSpec
from metalserve.executor.attention.kv_quant import QuantPool, SplitPool, quant_zeros
from metalserve.executor.attention.mlx import zeros_pool
from metalserve.executor.step_inputs import StepInputs
from metalserve.kernels.cpu import attention as cpu_attention
from metalserve.kernels.cpu.decoder_weights import QuantPages, quant_pages
from metalserve.kernels.cpu.paged import (
    CpuStepPlan,
    build_cpu_plan,
    cpu_paged_attention,
    cpu_quantized_attention,
    cpu_split_attention,
    host_view,
    host_views,
)


@dataclass
class HostKV:
    """The pool `[2, Hkv, num_slots, D]` and the host view of its buffer, through which it is written."""

    pool: mx.array
    host: np.ndarray

    def arrays(self) -> list[mx.array]:
        return [self.pool]

    @staticmethod
    def of(pool: mx.array) -> HostKV:
        return HostKV(pool, host_view(pool))  # host_view evaluates the pool first


@dataclass
class HostQuantKV:
    """Quantized pages (codes, float16 scales, q4's biases) and the host views of their buffers; k8v4's
    SplitPool keeps K's and V's arrays apart (`planes`), each plane in its own storage."""

    pool: QuantPool | SplitPool
    host: list[np.ndarray]  # every array's view, K's then V's where they are apart
    pages: QuantPages  # the same buffers as the one-call host decoder reads them
    planes: tuple[list[np.ndarray], list[np.ndarray]] | None = None  # (K's views, V's views) of a SplitPool

    def arrays(self) -> list[mx.array]:
        return self.pool.arrays()

    @staticmethod
    def of(pool: QuantPool | SplitPool) -> HostQuantKV:
        if isinstance(pool, SplitPool):
            k, v = host_views(pool.k.arrays()), host_views(pool.v.arrays())
            return HostQuantKV(pool, k + v, quant_pages(k, v), (k, v))
        views = host_views(pool.arrays())
        return HostQuantKV(pool, views, quant_pages(views))


CpuKV = HostKV | HostQuantKV


class CpuAttention(AttentionBackend[CpuKV, CpuStepPlan]):
    name = "cpu"
    description = "the numba CPU kernel (metalserve/kernels/cpu/attention.py)"

    def allocate(self, spec: LayerCacheSpec) -> CpuKV:
        if spec.dtype != mx.float32:
            raise ValueError(f"the CPU attention path needs a float32 pool (dtype {spec.dtype})")
        if spec.page.quantized:
            return HostQuantKV.of(_quant_zeros(spec))
        return HostKV.of(zeros_pool(spec))

    def extend(self, cache: CpuKV, spec: LayerCacheSpec) -> CpuKV:
        if isinstance(cache, HostQuantKV):
            more = _quant_zeros(spec)
            if isinstance(cache.pool, SplitPool) and isinstance(more, SplitPool):
                return HostQuantKV.of(cache.pool.concatenate(more))
            assert isinstance(cache.pool, QuantPool) and isinstance(more, QuantPool)
            return HostQuantKV.of(cache.pool.concatenate(more))
        return HostKV.of(mx.concatenate([cache.pool, zeros_pool(spec)], axis=2))

    def truncate(self, cache: CpuKV, spec: LayerCacheSpec) -> CpuKV:
        if isinstance(cache, HostQuantKV):
            return HostQuantKV.of(cache.pool.truncate(spec.num_slots))
        return HostKV.of(mx.contiguous(cache.pool[:, :, : spec.num_slots]))

    def build_metadata(self, step: StepInputs, spec: LayerCacheSpec) -> CpuStepPlan:
        return build_cpu_plan(
            step.padded_block_tables(), step.cu_seqlens_q, step.seq_lens, step.slot_mapping, spec.block_size
        )

    def forward(self, call: AttentionCall[CpuKV, CpuStepPlan]) -> mx.array:
        cache = call.cache
        if isinstance(cache, HostQuantKV):
            assert call.v is not None  # MLA latents are never quantized (kvcache/specs.MLALatent)
            if cache.planes is not None:
                return cpu_split_attention(call.q, call.k, call.v, cache.planes, cache.pages, call.meta, call.options)
            return cpu_quantized_attention(call.q, call.k, call.v, cache.host, call.meta, call.options)
        return cpu_paged_attention(call.q, call.k, call.v, cache.host, call.meta, call.options)

    def warm_up(self) -> None:
        # numba loads (or compiles) the kernel on its first call: ~1 s of CPU per process with a warm
        # cache, several seconds per rank on a loaded machine.
        cpu_attention.warm_up()


def _quant_zeros(spec: LayerCacheSpec) -> QuantPool | SplitPool:
    return quant_zeros(spec.num_planes, spec.num_kv_heads, spec.num_slots, spec.head_dim, spec.page, spec.dtype)
