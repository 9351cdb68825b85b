"""Builds the launches of the Metal paged-attention kernel from the backend contract's arguments.

The contract is `mlx_ops.paged_attention`'s (executor/attention/base.py). One launch covers the whole
packed batch; when few threadgroups would run over long contexts, the KV range is split into partitions
and a second launch merges them. The executor (Metal or the CPU emulator) is passed in, so both run
exactly the same launches.
"""

from __future__ import annotations

import logging
import math

import mlx.core as mx

from metalserve.kernels.metal.args import HEAD_DIMS, PagedArgs
from metalserve.kernels.metal.guard import Executor, LaunchRefused
from metalserve.kernels.metal.launch import KernelLaunch, metal_source
from metalserve.kernels.metal.tiled import tile_ladder, tiled_launch, tiling

__all__ = [
    "HEAD_DIMS",
    "KERNELS",
    "PagedArgs",
    "attention_launch",
    "choose_kernel",
    "num_partitions",
    "run_paged_attention",
]

SIMDGROUPS = 4  # per threadgroup: keys are dealt round-robin to them
DEFAULT_PARTITION = 256  # keys per threadgroup when the KV range is split
SPLIT_BELOW_GROUPS = 256  # split only when the unsplit grid would have fewer threadgroups than this

KERNELS = ("auto", "tiled", "decode")

logger = logging.getLogger("metalserve.kernels")


def num_partitions(a: PagedArgs, partition_size: int | None) -> int:
    """How many KV partitions to use; 1 means a single launch. Decided from static shapes only."""
    max_context = a.block_tables.shape[1] * a.block_size
    if partition_size is None:
        groups = a.q.shape[0] * a.k_pool.shape[1]
        if groups >= SPLIT_BELOW_GROUPS or max_context <= 2 * DEFAULT_PARTITION:
            return 1
        partition_size = DEFAULT_PARTITION
    if partition_size < 1:
        raise ValueError(f"partition_size must be >= 1, got {partition_size}")
    return max(1, math.ceil(max_context / partition_size))


def attention_launch(a: PagedArgs, partitions: int, partition_size: int) -> KernelLaunch:
    """The first (or only) launch: one threadgroup per (query token, KV head, partition)."""
    total_q, hq, d = a.q.shape
    hkv = a.k_pool.shape[1]
    dtype = a.compute_dtype
    split = partitions > 1
    k_scales, v_scales, k_biases, v_biases = a.scale_arrays()
    sinks = a.sinks.astype(mx.float32) if a.sinks is not None else mx.zeros((1,), mx.float32)
    template: tuple[tuple[str, mx.Dtype | int | bool], ...] = (
        ("T", dtype),
        ("O", mx.float32 if split else dtype),
        ("D", d),
        ("BS", a.block_size),
        ("G", hq // hkv),
        ("NSG", SIMDGROUPS),
        ("PART", partition_size if split else 0),
        ("WINDOW", a.sliding_window is not None),
        ("SOFTCAP", a.softcap is not None),
        ("SINKS", a.sinks is not None),
        ("INT8", a.storage == "int8"),
        ("Q4", a.storage == "q4"),
        ("GS", max(a.group_size, 1)),
    )
    out_shape = (partitions, total_q, hq, d) if split else (total_q, hq, d)
    ml_shape = (partitions, total_q, hq, 2) if split else (1,)
    return KernelLaunch(
        name="paged_attention",
        source=metal_source("paged_attention"),
        input_names=(
            "q",
            "k_pool",
            "v_pool",
            "block_tables",
            "cu_seqlens_q",
            "seq_lens",
            "sinks",
            "k_scales",
            "v_scales",
            "k_biases",
            "v_biases",
            "num_reqs",
            "max_blocks",
            "window",
            "scale",
            "softcap",
        ),
        output_names=("out", "part_ml"),
        inputs=(
            a.q.astype(dtype),
            a.k_pool,
            a.v_pool,
            a.block_tables.astype(mx.int32),
            a.cu_seqlens_q.astype(mx.int32),
            a.seq_lens.astype(mx.int32),
            sinks,
            k_scales,
            v_scales,
            k_biases,
            v_biases,
            int(a.seq_lens.shape[0]),
            int(a.block_tables.shape[1]),
            int(a.sliding_window or 0),
            float(a.scale),
            float(a.softcap or 1.0),
        ),
        output_shapes=(out_shape, ml_shape),
        output_dtypes=(mx.float32 if split else dtype, mx.float32),
        template=template,
        grid=(total_q * SIMDGROUPS * 32, hkv, partitions),
        threadgroup=(SIMDGROUPS * 32, 1, 1),
    )


def merge_launch(a: PagedArgs, part_o: mx.array, part_ml: mx.array) -> KernelLaunch:
    """The second launch of split-KV: one 32-thread threadgroup per (query token, query head)."""
    partitions, total_q, hq, d = part_o.shape
    sinks = a.sinks.astype(mx.float32) if a.sinks is not None else mx.zeros((1,), mx.float32)
    return KernelLaunch(
        name="paged_attention_merge",
        source=metal_source("paged_attention_merge"),
        input_names=("part_o", "part_ml", "sinks", "num_parts"),
        output_names=("out",),
        inputs=(part_o, part_ml, sinks, int(partitions)),
        output_shapes=((total_q, hq, d),),
        output_dtypes=(a.compute_dtype,),
        template=(("O", a.compute_dtype), ("D", d), ("SINKS", a.sinks is not None)),
        grid=(32 * total_q, hq, 1),
        threadgroup=(32, 1, 1),
    )


def choose_kernel(a: PagedArgs, kernel: str, partition_size: int | None) -> str:
    """ "tiled" or "decode", from shapes only: a batch with more query rows than requests has a prefill
    (or several queries of a request) and takes the tiled kernel; an all-decode batch keeps the
    one-token kernel and its split-KV, which read each K/V byte once per query token either way."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    fits = tiling(a.q.shape[1] // a.k_pool.shape[1], a.q.shape[2]) is not None
    if kernel == "tiled":
        if partition_size is not None:
            raise ValueError("partition_size applies to the decode kernel's split-KV, not to the tiled one")
        if not fits:
            raise ValueError("no query tile fits this many query heads per KV head")
        return kernel
    if kernel == "decode" or partition_size is not None or not fits:
        return "decode"
    return "tiled" if a.q.shape[0] > a.seq_lens.shape[0] else "decode"


def run_paged_attention(
    a: PagedArgs, execute: Executor, partition_size: int | None = None, kernel: str = "auto"
) -> mx.array:
    """Attention for the packed batch through `execute`; returns `[total_q, Hq, D]` in q's dtype.

    The launch ladder, for an executor that raises `LaunchRefused` (guard.py): the tiled kernel's tiles
    from the largest down to the smallest (tiled.tile_ladder), then the decode kernel (one query token
    per 128-thread threadgroup, any batch); when that is refused too, `LaunchRefused` reaches the caller
    (the backend then runs MLX ops). One warning names what was refused and what runs instead."""
    if a.q.shape[0] == 0:
        return mx.zeros(a.q.shape, a.q.dtype)
    refusals: list[LaunchRefused] = []
    if choose_kernel(a, kernel, partition_size) == "tiled":
        for t in tile_ladder(a.q.shape[1] // a.k_pool.shape[1], a.q.shape[2]):
            try:
                (out,) = execute(tiled_launch(a, t))
            except LaunchRefused as refused:
                refusals.append(refused)
                continue
            _warn_new(refusals, f"{t.threads}-thread tiles run instead")
            return out.astype(a.q.dtype)
    try:
        out = _run_decode(a, execute, partition_size)
    except LaunchRefused as refused:
        refusals.append(refused)
        raise LaunchRefused("; ".join(map(str, refusals)), first=any(r.first for r in refusals)) from None
    _warn_new(refusals, "the decode kernel runs instead")
    return out


def _run_decode(a: PagedArgs, execute: Executor, partition_size: int | None) -> mx.array:
    partitions = num_partitions(a, partition_size)
    size = partition_size or DEFAULT_PARTITION
    out, part_ml = execute(attention_launch(a, partitions, size))
    if partitions > 1:
        (out,) = execute(merge_launch(a, out, part_ml))
    return out.astype(a.q.dtype)


def _warn_new(refusals: list[LaunchRefused], instead: str) -> None:
    """One warning when a refusal was found by this call (later calls skip the refused rungs quietly)."""
    if any(r.first for r in refusals):
        logger.warning("%s; %s", "; ".join(map(str, refusals)), instead)
