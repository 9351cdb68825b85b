"""Four to eight decode rows dotted in integers at once (kernels/cpu/int8_windows.py): the same sums as the
int8 quantization done in NumPy for every row count and layout it takes, the float kernel's exact answer
for the rest (more than eight rows, bit planes narrower than a window)."""

from __future__ import annotations

import numpy as np
import pytest

from metalserve.kernels.cpu import int8_dot, int8_windows
from metalserve.kernels.cpu.packed_codes import half_bits
from metalserve.kernels.cpu.packed_linear import packed_linear, segments_of
from tests.kernels.test_int8_dot import _int8_reference
from tests.kernels.test_packed_codes import random_codes


@pytest.mark.parametrize(
    ("columns", "bits", "group"),
    [
        (896, 5, 32),  # Q5_0: windows reaching into two bit planes
        (576, 5, 32),  # half-rows of 4.5 windows: one window's nibbles from both halves
        (896, 6, 16),  # Q6_K's groups of 16
        (1536, 5, 64),  # groups of 64
        (576, 4, 32),  # Q4_0/Q4_1: one window's nibbles from both half-rows
        (1536, 4, 64),  # MLX's 4-bit groups of 64
        (576, 8, 32),  # Q8_0
    ],
)
@pytest.mark.parametrize("rows", [4, 6, 8])
def test_four_to_eight_rows_match_the_same_quantization(columns: int, bits: int, group: int, rows: int) -> None:
    """Each row's sums (6 rows: two overlapping passes of four) against NumPy quantizing as quantize_row
    does: only float32's rounding apart."""
    packed, dense = random_codes(45, columns, bits, group, seed=columns + bits + rows)
    assert int8_windows.windows_apply(bits, columns, group)
    x = np.random.default_rng(rows).standard_normal((rows, columns)).astype(np.float32)
    bias = np.random.default_rng(1).standard_normal((1, 45)).astype(np.float32)
    got = packed_linear(x, segments_of([[packed]], bias, int8=True))
    want = _int8_reference(x, packed.unpacked(), packed.scales, packed.biases) + bias
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    exact = x.astype(np.float64) @ dense.astype(np.float64).T + bias
    assert 0 < np.abs(got - exact).max() / np.abs(exact).max() < 2e-2


@pytest.mark.parametrize(("rows", "bits"), [(9, 4), (9, 5), (5, 5)])
def test_other_steps_keep_the_float_kernel(rows: int, bits: int) -> None:
    """Steps of more than eight rows: exact. 5 bits over 256 columns (bit planes narrower than a window)
    too."""
    columns = 256 if rows == 5 else 576
    packed, dense = random_codes(19, columns, bits, 32, seed=rows)
    x = np.random.default_rng(0).standard_normal((rows, columns)).astype(np.float32)
    want = x.astype(np.float64) @ dense.astype(np.float64).T
    got = packed_linear(x, segments_of([[packed]], int8=True))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 32), (4, 64), (8, 64)])
def test_the_kernel_reads_4_and_8_bit_codes_too(bits: int, group: int) -> None:
    """int8_window_rows itself, called directly, on 4- and 8-bit layouts: 8 rows against the same
    quantization in NumPy."""
    columns = 576
    packed, _ = random_codes(13, columns, bits, group, seed=bits + group)
    x = np.random.default_rng(3).standard_normal((8, columns)).astype(np.float32)
    xq = np.empty((8, columns), np.int8)
    scale, total = np.empty((8, columns // 32), np.float32), np.empty((8, columns // 32), np.float32)
    total16 = np.empty((8, columns // 16), np.float32)
    for r in range(8):
        int8_dot.quantize_row(x, r, xq[r], scale[r], total[r], total16[r])
    out = np.zeros((8, 13), np.float32)
    params = int8_windows.window_params(bits, columns)
    lanes = int8_windows.lane_scales(scale)
    codes = packed.codes
    scale_bits, offset_bits = half_bits(packed.scales), half_bits(packed.biases)
    int8_windows.int8_window_rows(
        xq, lanes, total, total16, codes, scale_bits, offset_bits, bits, params, 0, 8, 0, 13, out, 0
    )
    want = _int8_reference(x, packed.unpacked(), packed.scales, packed.biases)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
