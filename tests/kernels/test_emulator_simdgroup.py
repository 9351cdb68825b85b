"""The emulator's simdgroup_matrix (Apple's per-lane layout, collective participation) and its counts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metalserve.kernels.metal.launch import KernelLaunch
from tools.msl_emulator import EmulatorError, emulate, emulate_counted, emulate_race_checked

RNG = np.random.default_rng(3)
MMA_INPUT = RNG.standard_normal(8 * 12 + 64).astype(np.float32)
MMA_SOURCE = """
    uint l = thread_index_in_simdgroup;
    threadgroup float a[8 * 12];
    threadgroup float b[64];
    threadgroup float d[8 * 10];
    for (uint i = l; i < 96; i += 32) { a[i] = inp[i]; }
    for (uint i = l; i < 64; i += 32) { b[i] = inp[96 + i]; }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 ma;
    simdgroup_float8x8 mb;
    simdgroup_load(ma, a, 12, ulong2(3, 0));  // columns 3..10 of an 8 x 12 array
    simdgroup_load(mb, b, 8, ulong2(0, 0), true);  // the transpose of B
    simdgroup_float8x8 mc = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
    simdgroup_multiply_accumulate(mc, ma, mb, mc);
    simdgroup_store(mc, d, 10, ulong2(2, 0));  // columns 2..9 of an 8 x 10 array
    simdgroup_barrier(mem_flags::mem_threadgroup);
    out[2 * l] = mc.thread_elements()[0];
    out[2 * l + 1] = mc.thread_elements()[1];
    for (uint i = l; i < 80; i += 32) { out[64 + i] = d[i]; }
"""


def sg_launch(source: str, threads: int = 32, inputs: tuple = (mx.array(MMA_INPUT),)) -> KernelLaunch:
    return KernelLaunch(
        "sgm", source, ("inp",), ("out",), inputs, ((64 + 80,),), (mx.float32,), (), (threads, 1, 1), (threads, 1, 1)
    )


MMA = sg_launch(MMA_SOURCE)
PARTIAL_MMA = sg_launch(
    MMA_SOURCE.replace(
        "simdgroup_multiply_accumulate(mc, ma, mb, mc);",
        "if (l < 16) { simdgroup_multiply_accumulate(mc, ma, mb, mc); }",
    )
)
DIVERGENT_LOADS = sg_launch(
    MMA_SOURCE.replace(
        "simdgroup_load(mb, b, 8, ulong2(0, 0), true);",
        "if (l % 2) {\n simdgroup_load(mb, b, 8);\n } else {\n simdgroup_load(mb, b, 8, ulong2(0, 0), true);\n }",
    )
)
NON_UNIFORM = sg_launch(
    MMA_SOURCE.replace("simdgroup_load(ma, a, 12, ulong2(3, 0));", "simdgroup_load(ma, a + (l % 2), 12, ulong2(3, 0));")
)
PARTIAL_SIMDGROUP = sg_launch(
    MMA_SOURCE.replace("out[2 * l]", "out[2 * (l % 32)]").replace("out[2 * l + 1]", "out[2 * (l % 32) + 1]"), threads=48
)
COUNTS = KernelLaunch(
    "counts",
    """
    uint i = thread_position_in_grid.x;
    float4 v = *((const device float4*)(inp + 4 * i));
    float s = simd_sum(v.x + v.y + v.z + v.w);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[i] = s + small[i % 2] + float(n);
    """,
    ("inp", "small", "n"),
    ("out",),
    (mx.arange(256).astype(mx.float32), mx.ones(2), 3),
    ((64,),),
    (mx.float32,),
    (),
    (64, 1, 1),
    (32, 1, 1),
)
LAUNCHES = (MMA, PARTIAL_MMA, DIVERGENT_LOADS, NON_UNIFORM, PARTIAL_SIMDGROUP, COUNTS)


def apple_layout(lane: int) -> tuple[int, int]:
    """Row and first column of a lane's two elements, as MLX's steel MMA fragments index them."""
    qid = lane // 4
    return (qid & 4) + (lane // 2) % 4, (qid & 2) * 2 + (lane % 2) * 2


def test_load_transpose_multiply_accumulate_store() -> None:
    (out,) = emulate_race_checked(MMA)
    got = np.array(out)
    a = MMA_INPUT[:96].reshape(8, 12)[:, 3:11].astype(np.float64)
    b = MMA_INPUT[96:].reshape(8, 8).astype(np.float64)
    want = a @ b.T + 1.0
    for lane in range(32):  # each lane holds its two elements in Apple's layout
        r, c = apple_layout(lane)
        np.testing.assert_allclose(got[2 * lane : 2 * lane + 2], want[r, c : c + 2], rtol=1e-5)
    d = got[64:].reshape(8, 10)
    np.testing.assert_allclose(d[:, 2:], want, rtol=1e-5)
    assert np.isnan(d[:, :2]).all()  # never stored: threadgroup memory still poisoned


def test_matrix_op_reached_by_half_a_simdgroup() -> None:
    with pytest.raises(EmulatorError, match="divergent simdgroup operation|deadlock"):
        emulate(PARTIAL_MMA)


def test_lanes_at_different_matrix_loads() -> None:
    with pytest.raises(EmulatorError, match="divergent simdgroup operation"):
        emulate(DIVERGENT_LOADS)


def test_matrix_load_pointer_must_be_uniform() -> None:
    with pytest.raises(EmulatorError, match="lanes pass different pointers"):
        emulate(NON_UNIFORM)


def test_matrix_op_in_a_partial_simdgroup() -> None:
    with pytest.raises(EmulatorError, match="needs 32"):
        emulate(PARTIAL_SIMDGROUP)


def test_counts_bytes_per_buffer_barriers_and_simd_ops() -> None:
    (out,), counts = emulate_counted(COUNTS)
    assert counts.bytes_read == {"inp": 64 * 16, "small": 64 * 4}  # a float4 and a float per thread
    assert counts.barriers == 2 * 2 and counts.simd_ops == 2 and counts.simd_mma == 0
    _, mma = emulate_counted(MMA)
    assert mma.bytes_read == {"inp": len(MMA_INPUT) * 4}
    assert mma.simd_mma == 1 and mma.barriers == 1
    assert mma.simd_ops == 6  # two loads, a fill, the multiply-accumulate, a store, a simdgroup_barrier
    sums = np.arange(256, dtype=np.float32).reshape(64, 4).sum(1).reshape(2, 32).sum(1)
    np.testing.assert_array_equal(np.array(out), np.repeat(sums, 32) + 4.0)
