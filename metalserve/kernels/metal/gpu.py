"""The `mx.fast.metal_kernel` wrappers; `metal_paged_attention` honours the contract in
metalserve/executor/attention/base.py's
docstring. Which attention runs is chosen once, in metalserve/executor/attention/select.py, from the
Platform: this module probes no device."""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from metalserve.kernels.metal.guard import LaunchGuard
from metalserve.kernels.metal.launch import KernelLaunch
from metalserve.kernels.metal.paged import PagedArgs, run_paged_attention


@cache
def _kernel(
    name: str,
    input_names: tuple[str, ...],
    output_names: tuple[str, ...],
    source: str,
    header: str,
    atomic_outputs: bool,
) -> object:
    # One kernel object per body; MLX itself caches the compiled library per template instance.
    return mx.fast.metal_kernel(
        name=name,
        input_names=list(input_names),
        output_names=list(output_names),
        source=source,
        header=header,
        atomic_outputs=atomic_outputs,
    )


def run_metal(launch: KernelLaunch) -> list[mx.array]:
    """Execute one launch on the GPU with MLX's own kernel machinery."""
    kernel = _kernel(
        launch.name, launch.input_names, launch.output_names, launch.source, launch.header, launch.atomic_outputs
    )
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


# This process's verdicts on which kernel instances the GPU runs (guard.py).
GUARD = LaunchGuard(run_metal)


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
    k_scales: mx.array | None = None,
    v_scales: mx.array | None = None,
    k_biases: mx.array | None = None,
    v_biases: mx.array | None = None,
) -> mx.array:
    """The contract on the Metal kernels; `kernel` ("auto", "tiled", "decode") and `partition_size`
    (the decode kernel's split-KV) force a path for tests and benches. quantized pools come with their
    scales (and q4's biases; args.py). Raises guard.LaunchRefused when the GPU runs none of the launches (the
    backend then takes the MLX-ops path)."""
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
    return run_paged_attention(args, GUARD, partition_size, kernel)
