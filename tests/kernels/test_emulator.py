"""The emulator itself: it must catch the bugs that a GPU would hide, and agree with MLX's codegen."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from metalserve.kernels.metal.launch import KernelLaunch
from metalserve.kernels.metal.paged import PagedArgs, attention_launch
from metalserve.kernels.metal.tiled import tiled_launch, tiling
from tests.kernels.cases import CASES, make_inputs
from tools.msl_emulator import EmulatorError, emulate, emulate_race_checked
from tools.msl_emulator.signature import generate


def launch(
    source: str,
    inputs: tuple,
    n: int = 64,
    tg: int = 64,
    out_dtype: mx.Dtype = mx.float32,
    out_size: int | None = None,
    **kw: object,
) -> KernelLaunch:
    names = ("inp", "scale", "n")[: len(inputs)]
    return KernelLaunch(
        "t",
        source,
        names,
        ("out",),
        inputs,
        ((out_size or n,),),
        (out_dtype,),
        (("T", mx.float32),),
        (n, 1, 1),
        (tg, 1, 1),
        **kw,
    )  # type: ignore[arg-type]


ROTATE = """
    uint i = thread_index_in_threadgroup;
    threadgroup float buf[64];
    buf[i] = inp[thread_position_in_grid.x];
    {barrier}
    out[thread_position_in_grid.x] = buf[(i + 1) % 64];
"""
SIMD_SOURCE = """
    uint lane = thread_index_in_simdgroup;
    float v = inp[thread_position_in_grid.x];
    uint o = thread_position_in_grid.x * 6;
    out[o] = simd_sum(v);
    out[o + 1] = simd_max(v);
    out[o + 2] = simd_shuffle_xor(v, 1);
    out[o + 3] = simd_shuffle_down(v, 4);
    out[o + 4] = simd_broadcast(v, 7);
    out[o + 5] = simd_prefix_exclusive_sum(v) + float(lane) * 0.0f;
"""
ATTRS_SOURCE = """
    uint3 g = thread_position_in_grid;
    uint idx = g.y * threads_per_grid.x + g.x;
    out[idx] = float(threadgroup_position_in_grid.x * 1000 + threadgroup_position_in_grid.y * 100
                     + simdgroup_index_in_threadgroup * 10 + thread_position_in_threadgroup.y);
"""
SIMD_INPUT = np.random.default_rng(1).integers(0, 9, 64).astype(np.float32)
ZEROS = mx.zeros(64)
X64 = mx.arange(64).astype(mx.float32)

# Every launch is built at import, so conftest.py can compile them all in parallel before the tests.
ROTATE_OK = launch(
    ROTATE.format(barrier="threadgroup_barrier(mem_flags::mem_threadgroup);"),
    (mx.arange(128).astype(mx.float32),),
    n=128,
)
ROTATE_RACY = launch(ROTATE.format(barrier=""), (X64,))
UNINITIALISED = launch(
    "threadgroup float buf[64]; out[thread_position_in_grid.x] = buf[thread_index_in_threadgroup];", (ZEROS,)
)
PARTIAL_BARRIER = launch(
    """
    if (thread_index_in_threadgroup < 16) { threadgroup_barrier(mem_flags::mem_threadgroup); }
    out[thread_position_in_grid.x] = inp[0];
    """,
    (ZEROS,),
)
DIVERGENT_BARRIERS = launch(
    """
    if (thread_index_in_threadgroup % 2) { threadgroup_barrier(mem_flags::mem_threadgroup); }
    else { threadgroup_barrier(mem_flags::mem_threadgroup); }
    out[thread_position_in_grid.x] = inp[0];
    """,
    (ZEROS,),
)
DIVERGENT_SIMD = launch(
    """
    float v = inp[thread_position_in_grid.x];
    if (thread_index_in_simdgroup < 16) { v = simd_sum(v); }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[thread_position_in_grid.x] = v;
    """,
    (ZEROS,),
)
TOO_MUCH_TG_MEMORY = launch(
    "threadgroup float big[8193]; big[0] = 1; out[thread_position_in_grid.x] = inp[0];", (ZEROS,)
)
COPY_OK = launch("out[thread_position_in_grid.x] = inp[thread_position_in_grid.x];", (X64,))
COPY_OOB = launch("out[thread_position_in_grid.x] = inp[thread_position_in_grid.x + 1];", (X64,))
SIMD = launch(SIMD_SOURCE, (mx.array(SIMD_INPUT),), out_size=64 * 6)
ATTRS = KernelLaunch(
    "attrs", ATTRS_SOURCE, ("inp",), ("out",), (mx.zeros(8),), ((64 * 4,),), (mx.float32,), (), (64, 4, 1), (32, 2, 1)
)
ATOMICS = KernelLaunch(
    "atomics",
    """
    threadgroup atomic_int seen;
    if (thread_index_in_threadgroup == 0) { atomic_store_explicit(&seen, 0, memory_order_relaxed); }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    atomic_fetch_add_explicit(&seen, 1, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (thread_index_in_threadgroup == 0) {
      atomic_fetch_add_explicit(&out[0], float(atomic_load_explicit(&seen, memory_order_relaxed)),
                                memory_order_relaxed);
    }
    atomic_fetch_max_explicit(&out[1], inp[thread_position_in_grid.x], memory_order_relaxed);
    """,
    ("inp",),
    ("out",),
    (X64,),
    ((2,),),
    (mx.float32,),
    (),
    (64, 1, 1),
    (16, 1, 1),
    atomic_outputs=True,
    init_value=0.0,
)
LAUNCHES = (
    ATOMICS,
    ROTATE_OK,
    ROTATE_RACY,
    UNINITIALISED,
    PARTIAL_BARRIER,
    DIVERGENT_BARRIERS,
    DIVERGENT_SIMD,
    TOO_MUCH_TG_MEMORY,
    SIMD,
    ATTRS,
)
ASAN_LAUNCHES = (COPY_OK, COPY_OOB)


def test_barrier_makes_neighbours_visible() -> None:
    (out,) = emulate_race_checked(ROTATE_OK)
    want = np.arange(128).reshape(2, 64)
    np.testing.assert_array_equal(np.array(out), np.roll(want, -1, axis=1).reshape(-1))


def test_missing_barrier_is_caught() -> None:
    with pytest.raises(EmulatorError, match="depends on thread order"):
        emulate_race_checked(ROTATE_RACY)


def test_threadgroup_memory_starts_as_nan() -> None:
    (out,) = emulate(UNINITIALISED)
    assert np.isnan(np.array(out)).all()


def test_barrier_reached_by_part_of_the_group() -> None:
    with pytest.raises(EmulatorError, match="reached by only 16 of 64"):
        emulate(PARTIAL_BARRIER)


def test_divergent_barriers_are_caught() -> None:
    with pytest.raises(EmulatorError, match="divergent threadgroup_barrier"):
        emulate(DIVERGENT_BARRIERS)


def test_simd_op_in_divergent_code_deadlocks() -> None:
    with pytest.raises(EmulatorError, match="deadlock"):
        emulate(DIVERGENT_SIMD)


def test_threadgroup_memory_over_32_kib() -> None:
    with pytest.raises(EmulatorError, match="over 32 KiB"):
        emulate(TOO_MUCH_TG_MEMORY)


def test_out_of_bounds_read_caught_by_asan() -> None:
    (out,) = emulate(COPY_OK, asan=True)
    np.testing.assert_array_equal(np.array(out), np.arange(64))
    with pytest.raises(EmulatorError, match="heap-buffer-overflow"):
        emulate(COPY_OOB, asan=True)


def test_simd_functions() -> None:
    (out,) = emulate(SIMD)
    got = np.array(out).reshape(2, 32, 6)
    lanes = np.arange(32)
    for s, v in enumerate(SIMD_INPUT.reshape(2, 32)):
        np.testing.assert_array_equal(got[s, :, 0], v.sum())
        np.testing.assert_array_equal(got[s, :, 1], v.max())
        np.testing.assert_array_equal(got[s, :, 2], v[lanes ^ 1])
        np.testing.assert_array_equal(got[s, :, 3], np.where(lanes + 4 < 32, v[np.minimum(lanes + 4, 31)], v))
        np.testing.assert_array_equal(got[s, :, 4], v[7])
        np.testing.assert_array_equal(got[s, :, 5], np.cumsum(v) - v)


def test_atomics_on_device_and_threadgroup_memory() -> None:
    (out,) = emulate_race_checked(ATOMICS)
    np.testing.assert_array_equal(np.array(out), [64.0, 63.0])  # 4 groups x 16 threads; max of 0..63


def test_thread_position_attributes() -> None:
    (out,) = emulate(ATTRS)
    got = np.array(out).reshape(4, 64)
    y, x = np.mgrid[0:4, 0:64]
    linear = (y % 2) * 32 + x % 32  # index inside the 32 x 2 group
    want = (x // 32) * 1000 + (y // 2) * 100 + (linear // 32) * 10 + (y % 2)
    np.testing.assert_array_equal(got, want)


def _mlx_generated(k: KernelLaunch, capfd: pytest.CaptureFixture[str], tmp_path: Path) -> str:
    """MLX's own generated source: metal_kernel traces without Metal inside export_function."""
    kernel: Any = mx.fast.metal_kernel(
        name=k.name,
        input_names=list(k.input_names),
        output_names=list(k.output_names),
        source=k.source,
        header=k.header,
        atomic_outputs=k.atomic_outputs,
    )
    arrays = [v for v in k.inputs if isinstance(v, mx.array)]

    def traced(*xs: mx.array) -> Any:
        it = iter(xs)
        inputs = [next(it) if isinstance(v, mx.array) else v for v in k.inputs]
        return kernel(
            inputs=inputs,
            template=list(k.template),
            grid=k.grid,
            threadgroup=k.threadgroup,
            output_shapes=[list(s) for s in k.output_shapes],
            output_dtypes=list(k.output_dtypes),
            verbose=True,
        )

    capfd.readouterr()
    mx.export_function(str(tmp_path / "kernel.mlxfn"), traced, *arrays)
    printed = capfd.readouterr().out
    match = re.search(r"```\n(.*)\n```", printed, re.S)
    assert match, printed
    return match.group(1)


def test_signature_matches_mlx_for_every_parameter_kind(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    src = """
    uint i = thread_position_in_grid.x + simdgroup_index_in_threadgroup * 0 + threads_per_simdgroup * 0;
    out[i] = T(inp[i] * scale + small[0] + float(n) + float(inp_ndim) + float(inp_shape[0]));
    """
    k = KernelLaunch(
        "sig",
        src,
        ("inp", "small", "scale", "n"),
        ("out", "out2"),
        (mx.zeros((4, 8)), mx.zeros(3, mx.float16), 0.5, 7),
        ((32,), (2,)),
        (mx.bfloat16, mx.int32),
        (("T", mx.bfloat16), ("N", 3), ("FLAG", True)),
        (32, 1, 1),
        (32, 1, 1),
        atomic_outputs=True,
    )
    assert generate(k).source == _mlx_generated(k, capfd, tmp_path)


@pytest.mark.parametrize("kernel", ["decode", "tiled"])
def test_signature_matches_mlx_for_the_attention_kernels(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, kernel: str
) -> None:
    case = CASES[0]
    x = make_inputs(case)
    args = PagedArgs(
        x.q, x.k_pool, x.v_pool, x.block_tables, x.cu_seqlens_q, x.seq_lens, case.block_size, x.scale, None, None, None
    )
    tiles = tiling(case.num_q_heads // case.num_kv_heads, case.head_dim)
    assert tiles is not None
    k = attention_launch(args, 1, 256) if kernel == "decode" else tiled_launch(args, tiles)
    assert generate(k).source == _mlx_generated(k, capfd, tmp_path)
