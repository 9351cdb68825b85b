"""The contract's attention function computed by the Metal kernel's exact source on the CPU emulator."""

from __future__ import annotations

import mlx.core as mx

from metalserve.kernels.metal.paged import PagedArgs, run_paged_attention
from tools.msl_emulator import emulate


def emulated_paged_attention(
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
    k_scales: mx.array | None = None,
    v_scales: mx.array | None = None,
    k_biases: mx.array | None = None,
    v_biases: mx.array | None = None,
) -> mx.array:
    """Same signature as mlx_ops.paged_attention (plus quantized pools' scales and biases, as the Metal entry point);
    slow (every GPU thread is a CPU fiber)."""
    args = PagedArgs(
        q,
        k_pool,
        v_pool,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        block_size,
        scale,
        sliding_window,
        softcap,
        sinks,
        k_scales=k_scales,
        v_scales=v_scales,
        k_biases=k_biases,
        v_biases=v_biases,
    )
    return run_paged_attention(args, emulate, partition_size, kernel)
