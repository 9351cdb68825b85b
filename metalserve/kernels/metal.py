"""The `mx.fast.metal_kernel` wrappers and the one attention entry point the model calls.

`paged_attention` runs the Metal kernel (paged_attention.metal) where `mx.metal.is_available()` and the
portable MLX path (reference.py) elsewhere; both honour the contract in reference.py's docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import mlx.core as mx

from metalserve.kernels import reference
from metalserve.kernels.launch import KernelLaunch
from metalserve.kernels.paged import PagedArgs, run_paged_attention

AttentionFn = Callable[..., mx.array]


@cache
def _kernel(name: str, input_names: tuple[str, ...], output_names: tuple[str, ...], source: str,
            header: str, atomic_outputs: bool) -> object:
    # One kernel object per body; MLX itself caches the compiled library per template instance.
    return mx.fast.metal_kernel(name=name, input_names=list(input_names), output_names=list(output_names),
                                source=source, header=header, atomic_outputs=atomic_outputs)


def run_metal(launch: KernelLaunch) -> list[mx.array]:
    """Execute one launch on the GPU with MLX's own kernel machinery."""
    kernel = _kernel(launch.name, launch.input_names, launch.output_names, launch.source, launch.header,
                     launch.atomic_outputs)
    outputs: list[mx.array] = kernel(  # type: ignore[operator]
        inputs=list(launch.inputs),
        template=list(launch.template),
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=[list(s) for s in launch.output_shapes],
        output_dtypes=list(launch.output_dtypes),
        init_value=launch.init_value,
    )
    return list(outputs)


def metal_paged_attention(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    cu_seqlens_q: mx.array,
    seq_lens: mx.array,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
    partition_size: int | None = None,
    kernel: str = "auto",
) -> mx.array:
    """The contract on the Metal kernels; `kernel` ("auto", "tiled", "decode") and `partition_size`
    (the decode kernel's split-KV) force a path for tests and benches."""
    args = PagedArgs(q, k_pool, v_pool, block_tables, cu_seqlens_q, seq_lens, block_size, scale,
                     sliding_window, softcap, sinks)
    return run_paged_attention(args, run_metal, partition_size, kernel)


def paged_attention(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    cu_seqlens_q: mx.array,
    seq_lens: mx.array,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """The entry point: the Metal kernel where Metal exists, else the portable MLX path."""
    fn = metal_paged_attention if mx.metal.is_available() else reference.paged_attention
    return fn(q, k_pool, v_pool, block_tables, cu_seqlens_q, seq_lens, block_size=block_size, scale=scale,
              sliding_window=sliding_window, softcap=softcap, sinks=sinks)


def attention_backend(name: str) -> AttentionFn:
    """The attention function for EngineConfig.attention_backend ("auto", "metal", "reference",
    or "emulator": the Metal source run on the CPU, slow, for checks only)."""
    if name == "auto":
        return paged_attention
    if name == "metal":
        if not mx.metal.is_available():
            raise RuntimeError("attention_backend='metal' needs a Metal device; use 'auto' or 'reference'")
        return metal_paged_attention
    if name == "reference":
        return reference.paged_attention
    if name == "emulator":
        from metalserve.kernels.emulated import emulated_paged_attention

        return emulated_paged_attention
    raise ValueError(f"unknown attention backend {name!r}: use auto, metal, reference or emulator")


def write_kv(
    k_pool: mx.array, v_pool: mx.array, k: mx.array, v: mx.array, slot_mapping: mx.array
) -> tuple[mx.array, mx.array]:
    """Scatter new K/V into the pools at `slot_mapping`.

    A `metal_kernel` always writes fresh output buffers, so a kernel writer would copy the whole pool
    every step; MLX's scatter reuses the donated pool buffer and costs O(tokens). It stays the writer.
    """
    return reference.write_kv(k_pool, v_pool, k, v, slot_mapping)
