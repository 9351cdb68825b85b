"""The kernel backend (`--attention-backend metal`): the contract's slot-major pools `[num_slots, Hkv, D]`
(metalserve/executor/attention/reference.py) attended by a function with the contract's signature: the Metal
kernel, or in tests its CPU emulation or the MLX reference."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from metalserve.executor.attention.base import AttentionBackend, AttentionCall, LayerCacheSpec
from metalserve.executor.attention.kv_quant import quantize
from metalserve.executor.attention.reference import paged_attention, write_kv
from metalserve.executor.step_inputs import StepInputs
from metalserve.kernels.metal.guard import LaunchRefused
from metalserve.kvcache.specs import PageDtype

logger = logging.getLogger("metalserve.engine")

# A function with the contract of metalserve.executor.attention.reference.paged_attention.
KernelFn = Callable[..., mx.array]


@dataclass
class LayerKV:
    """One layer's K and V pools, `[num_slots, Hkv, D]` each; each step's scatter replaces them with its
    outputs, which reuse the same buffers. int8 pages (--kv-cache-dtype int8): the pools hold codes and
    `k_scales` / `v_scales` `[num_slots, Hkv]` one float16 scale per slot and KV head."""

    k: mx.array
    v: mx.array
    k_scales: mx.array | None = None
    v_scales: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        scales = [self.k_scales, self.v_scales] if self.k_scales is not None and self.v_scales is not None else []
        return [self.k, self.v, *scales]


@dataclass(frozen=True)
class KernelStep:
    """The contract's per-step arrays."""

    block_tables: mx.array  # [R, width] int32
    cu_seqlens_q: mx.array  # [R + 1] int32
    seq_lens: mx.array  # [R] int32
    block_size: int


# The page storages the Metal kernels read (kernels/metal/args.py); select.py offers no other.
METAL_STORAGES = ("auto", "int8")
INT8_PAGE = PageDtype(storage="int8")  # quantize() reads only the storage of an int8 page


def _zeros(spec: LayerCacheSpec) -> LayerKV:
    shape = (spec.num_slots, spec.num_kv_heads, spec.head_dim)
    if spec.page.storage == "auto":
        return LayerKV(mx.zeros(shape, spec.dtype), mx.zeros(shape, spec.dtype))
    if spec.page.storage != "int8":
        raise ValueError(f"the Metal kernels read {METAL_STORAGES} KV pages, not {spec.page.storage}")
    scales = shape[:2]
    return LayerKV(
        mx.zeros(shape, mx.int8), mx.zeros(shape, mx.int8), mx.zeros(scales, mx.float16), mx.zeros(scales, mx.float16)
    )


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
        cache = _zeros(spec)
        mx.eval(*cache.arrays())
        return cache

    def extend(self, cache: LayerKV, spec: LayerCacheSpec) -> LayerKV:
        more = _zeros(spec)
        return LayerKV(*(mx.concatenate([a, b]) for a, b in zip(cache.arrays(), more.arrays(), strict=True)))

    def build_metadata(self, step: StepInputs, spec: LayerCacheSpec) -> KernelStep:
        return KernelStep(
            mx.array(step.padded_block_tables()), mx.array(step.cu_seqlens_q), mx.array(step.seq_lens), spec.block_size
        )

    def forward(self, call: AttentionCall[LayerKV, KernelStep]) -> mx.array:
        cache, meta = call.cache, call.meta
        if call.v is None:
            raise ValueError(f"the {self.name} kernel needs V of its own (MLA's latent layout is not supported)")
        if cache.k_scales is not None and cache.v_scales is not None:
            _write_int8(cache, call.k, call.v, call.slot_mapping)
        else:
            cache.k, cache.v = write_kv(cache.k, cache.v, call.k, call.v, call.slot_mapping)
        try:
            return _attend(self.kernel, call, cache, meta)
        except LaunchRefused as refused:  # the device runs no launch of this shape: MLX ops, same contract
            if refused.first and not self.warned:
                self.warned = True
                logger.warning("%s; MLX ops run the attention the GPU refuses (this is said once)", refused)
            return _attend(paged_attention, call, _dequantized(cache, call.q.dtype), meta)


def _write_int8(cache: LayerKV, k: mx.array, v: mx.array, slot_mapping: mx.array) -> None:
    """Quantize new K/V `[T, Hkv, D]` (kv_quant.py's int8 format) and scatter codes and scales."""
    k_codes, k_scales, _ = quantize(k, INT8_PAGE)
    v_codes, v_scales, _ = quantize(v, INT8_PAGE)
    cache.k[slot_mapping] = k_codes
    cache.v[slot_mapping] = v_codes
    assert cache.k_scales is not None and cache.v_scales is not None
    cache.k_scales[slot_mapping] = k_scales[..., 0]
    cache.v_scales[slot_mapping] = v_scales[..., 0]


def _dequantized(cache: LayerKV, dtype: mx.Dtype) -> LayerKV:
    """Float pools for the MLX-ops fallback (whole pools: only for a launch the GPU refuses)."""
    if cache.k_scales is None or cache.v_scales is None:
        return cache
    k = (cache.k.astype(mx.float32) * cache.k_scales[..., None].astype(mx.float32)).astype(dtype)
    v = (cache.v.astype(mx.float32) * cache.v_scales[..., None].astype(mx.float32)).astype(dtype)
    return LayerKV(k, v)


def _attend(fn: KernelFn, call: AttentionCall[LayerKV, KernelStep], cache: LayerKV, meta: KernelStep) -> mx.array:
    opts = call.options
    scales = {"k_scales": cache.k_scales, "v_scales": cache.v_scales} if cache.k_scales is not None else {}
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
        **scales,
    )


def metal_attention() -> KernelAttention:
    """The Metal kernel (kernels/metal/gpu.py); only where the Platform has Metal."""
    from metalserve.kernels.metal.gpu import metal_paged_attention

    return KernelAttention(metal_paged_attention)
