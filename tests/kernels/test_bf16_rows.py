"""Packed codes straight to bfloat16 rows (kernels/cpu/bf16_rows.py), the prefill GEMM's tiles: bit for bit
what unpacking to fp32 and rounding gives, on every layout it takes."""

from __future__ import annotations

import numpy as np
import pytest

from metalserve.kernels.cpu import bf16_rows, int8_windows
from metalserve.kernels.cpu.gemm import to_bf16
from metalserve.kernels.cpu.packed_unpack import unpack_row
from metalserve.platform import current_platform
from tests.kernels.test_packed_codes import random_codes

pytestmark = pytest.mark.skipif(not current_platform().numba, reason="the CPU kernels need numba")


@pytest.mark.parametrize(
    ("columns", "bits", "group"),
    [
        (896, 5, 32),  # the coder's Q5_0: windows reaching into two bit planes
        (576, 5, 32),  # one window's nibbles from both half-rows
        (4864, 6, 16),  # Q6_K's groups of 16 (the coder's down projection)
        (576, 4, 32),  # Q4_0 / Q4_1
        (1536, 4, 64),  # MLX's 4-bit groups of 64
        (896, 8, 32),  # Q8_0
    ],
)
def test_rows_equal_unpacking_then_rounding(columns: int, bits: int, group: int) -> None:
    packed, _ = random_codes(21, columns, bits, group, seed=columns + bits)
    assert bf16_rows.rows_apply(bits, columns, group)
    flat = packed.kernel_arrays()
    groups = columns // group
    got = np.zeros((5, columns), np.uint16)
    params = int8_windows.window_params(bits, columns)
    bf16_rows.rows_to_bf16(*flat, 13, 5, bits, columns, groups, params, got)  # rows 13 to 17
    row = np.empty((1, columns), np.float32)
    want = np.empty((5, columns), np.uint16)
    for j in range(5):
        unpack_row(*flat, 13 + j, bits, columns, groups, row, 0)
        to_bf16(row[0], want[j])
    np.testing.assert_array_equal(got, want)


def test_other_layouts_are_left_to_unpack_row() -> None:
    assert not bf16_rows.rows_apply(4, 96, 32)  # not whole windows of 64 columns
    assert not bf16_rows.rows_apply(4, 768, 192)  # a group the lanes cannot find by a shift
    assert not bf16_rows.rows_apply(5, 256, 32)  # bit planes narrower than a window
