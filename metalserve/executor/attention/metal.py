"""The kernel backend (`--attention-backend metal`): the contract's slot-major pools `[num_slots, Hkv, D]`
(metalserve/executor/attention/mlx_ops.py) attended by a function with the contract's signature: the Metal
kernel, or in tests its CPU emulation or the MLX reference."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from metalserve.executor.attention.base import AttentionBackend, AttentionCall, LayerCacheSpec
from metalserve.executor.attention.kv_quant import dequantize, quantize
from metalserve.executor.attention.mlx_ops import paged_attention, write_kv
from metalserve.executor.step_inputs import StepInputs
from metalserve.kernels.metal.guard import LaunchRefused
from metalserve.kvcache.specs import PageDtype

logger = logging.getLogger("metalserve.engine")

# A function with the contract of metalserve.executor.attention.mlx_ops.paged_attention.
KernelFn = Callable[..., mx.array]


@dataclass
class LayerKV:
    """One layer's K and V pools, `[num_slots, Hkv, D]` each; each step's scatter replaces them with its
    outputs, which reuse the same buffers. Quantized pages (--kv-cache-dtype, kernels/metal/args.py):
    int8 pools hold codes and `k_scales` / `v_scales` `[num_slots, Hkv]`; q4 pools `[num_slots, Hkv, D/2]`
    hold two codes a byte and the scales and `k_biases` / `v_biases` `[num_slots, Hkv, D/group]`."""

    k: mx.array
    v: mx.array
    k_scales: mx.array | None = None
    v_scales: mx.array | None = None
    k_biases: mx.array | None = None
    v_biases: mx.array | None = None
    page: PageDtype | None = None  # the quantized pages' format; None for float pools

    def arrays(self) -> list[mx.array]:
        extra = (self.k_scales, self.v_scales, self.k_biases, self.v_biases)
        return [self.k, self.v, *(a for a in extra if a is not None)]

    def with_arrays(self, arrays: list[mx.array]) -> LayerKV:
        """The same kind of cache over other arrays (in `arrays()`'s order)."""
        names = [n for n in ("k_scales", "v_scales", "k_biases", "v_biases") if getattr(self, n) is not None]
        return LayerKV(arrays[0], arrays[1], page=self.page, **dict(zip(names, arrays[2:], strict=True)))


@dataclass(frozen=True)
class KernelStep:
    """The contract's per-step arrays."""

    block_tables: mx.array  # [R, width] int32
    cu_seqlens_q: mx.array  # [R + 1] int32
    seq_lens: mx.array  # [R] int32
    block_size: int


# The Metal kernels read every page storage (kernels/metal/args.py).
METAL_STORAGES = ("auto", "int8", "q4")  # not k8v4: the kernels read K and V in one format


def _zeros(spec: LayerCacheSpec) -> LayerKV:
    shape = (spec.num_slots, spec.num_kv_heads, spec.head_dim)
    page = spec.page
    if page.storage == "auto":
        return LayerKV(mx.zeros(shape, spec.dtype), mx.zeros(shape, spec.dtype))
    if page.storage == "int8":
        scales = shape[:2]
        return LayerKV(
            mx.zeros(shape, mx.int8),
            mx.zeros(shape, mx.int8),
            mx.zeros(scales, mx.float16),
            mx.zeros(scales, mx.float16),
            page=page,
        )
    if page.storage != "q4":
        raise ValueError(f"the Metal kernels read {METAL_STORAGES} KV pages, not {page.storage}")
    codes = (*shape[:2], spec.head_dim // 2)
    groups = (*shape[:2], spec.head_dim // page.group_for(spec.head_dim))
    ks, vs, kb, vb = (mx.zeros(groups, mx.float16) for _ in range(4))
    return LayerKV(mx.zeros(codes, mx.uint8), mx.zeros(codes, mx.uint8), ks, vs, kb, vb, page=page)


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
        return cache.with_arrays([mx.concatenate([a, b]) for a, b in zip(cache.arrays(), more.arrays(), strict=True)])

    def truncate(self, cache: LayerKV, spec: LayerCacheSpec) -> LayerKV:
        return cache.with_arrays([mx.contiguous(a[: spec.num_slots]) for a in cache.arrays()])

    def build_metadata(self, step: StepInputs, spec: LayerCacheSpec) -> KernelStep:
        return KernelStep(
            mx.array(step.padded_block_tables()), mx.array(step.cu_seqlens_q), mx.array(step.seq_lens), spec.block_size
        )

    def forward(self, call: AttentionCall[LayerKV, KernelStep]) -> mx.array:
        cache, meta = call.cache, call.meta
        if call.v is None:
            raise ValueError(f"the {self.name} kernel needs V of its own (MLA's latent layout is not supported)")
        if cache.page is not None:
            _write_quantized(cache, call.k, call.v, call.slot_mapping, cache.page)
        else:
            cache.k, cache.v = write_kv(cache.k, cache.v, call.k, call.v, call.slot_mapping)
        try:
            return _attend(self.kernel, call, cache, meta)
        except LaunchRefused as refused:  # the device runs no launch of this shape: MLX ops, same contract
            if refused.first and not self.warned:
                self.warned = True
                logger.warning("%s; MLX ops run the attention the GPU refuses (this is said once)", refused)
            return _attend(paged_attention, call, _dequantized(cache, call.q.dtype), meta)


def _write_quantized(cache: LayerKV, k: mx.array, v: mx.array, slot_mapping: mx.array, page: PageDtype) -> None:
    """Quantize new K/V `[T, Hkv, D]` (kv_quant.py's formats) and scatter codes, scales (and biases)."""
    for plane, x in (("k", k), ("v", v)):
        codes, scales, biases = quantize(x, page)
        getattr(cache, plane)[slot_mapping] = codes
        getattr(cache, f"{plane}_scales")[slot_mapping] = scales[..., 0] if page.storage == "int8" else scales
        if biases is not None:
            getattr(cache, f"{plane}_biases")[slot_mapping] = biases


def _dequantized(cache: LayerKV, dtype: mx.Dtype) -> LayerKV:
    """Float pools for the MLX-ops fallback (whole pools: only for a launch the GPU refuses)."""
    if cache.page is None:
        return cache
    planes = []
    for codes, scales, biases in ((cache.k, cache.k_scales, cache.k_biases), (cache.v, cache.v_scales, cache.v_biases)):
        assert scales is not None
        if cache.page.storage == "int8":
            scales = scales[..., None]
        planes.append(dequantize(codes, scales, biases, cache.page, dtype))
    return LayerKV(planes[0], planes[1])


def _attend(fn: KernelFn, call: AttentionCall[LayerKV, KernelStep], cache: LayerKV, meta: KernelStep) -> mx.array:
    opts = call.options
    names = ("k_scales", "v_scales", "k_biases", "v_biases")
    scales = {n: getattr(cache, n) for n in names if getattr(cache, n) is not None}
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
