"""Rows of packed codes (packed_codes.py) straight to bfloat16, 64 columns a step: the tiles the prefill's
bfloat16 GEMM (packed_gemm.py, `--cpu-bf16-prefill`) multiplies.

unpack_row goes through fp32 a bit plane at a time, then scales by group, then gemm.to_bf16 rounds: with
the coder 0.5B's Q5_0 that took more of a 512-token prefill chunk than MKL's GEMM itself. Here each
64-column window's codes are built as bytes the way the int8 kernel builds them (int8_windows.window_codes:
masked loads of the nibbles and the high bit planes), then 16 at a time widened to fp32, scaled and offset
by their group (every group is 16 columns or a multiple of 16, so 16 lanes share one), rounded to the
nearest bfloat16 (ties to even, as to_bf16) and stored.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from metalserve.kernels.cpu.int8_dot import broadcast, pointer, widen_halves
from metalserve.kernels.cpu.int8_windows import window_codes, windows_apply

_I64, _I32, _I16, _F32 = ir.IntType(64), ir.IntType(32), ir.IntType(16), ir.FloatType()
_LANES = 16


def _to_bf16(builder: ir.IRBuilder, values: ir.Value) -> ir.Value:
    """16 float32 rounded to the nearest bfloat16, ties to even: (bits + 0x7FFF + bit 16) >> 16."""
    words_t = ir.VectorType(_I32, _LANES)
    bits = builder.bitcast(values, words_t)
    odd = builder.and_(builder.lshr(bits, ir.Constant(words_t, [16] * _LANES)), ir.Constant(words_t, [1] * _LANES))
    rounded = builder.add(builder.add(bits, ir.Constant(words_t, [0x7FFF] * _LANES)), odd)
    high = builder.lshr(rounded, ir.Constant(words_t, [16] * _LANES))
    return builder.trunc(high, ir.VectorType(ir.IntType(16), _LANES))


def _row_to_bf16_typing(
    typingctx: Any,
    params_at: Any,
    windows: Any,
    row_at: Any,
    scales_at: Any,
    biases_at: Any,
    group_shift: Any,
    out_at: Any,
    nibble_mask: Any,
    high_mask: Any,
) -> Any:
    """(window_params, windows, the row's codes, its scales and offsets (float16), log2 of the group size,
    the bfloat16 row to write, the nibble and high-bit masks): every window of the row, dequantized."""
    sig = types.void(params_at, windows, row_at, scales_at, biases_at, group_shift, out_at, nibble_mask, high_mask)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        params, count, row, scales, biases, shift, out, nibbles, highs = args
        floats_t = ir.VectorType(_F32, _LANES)
        halves_t = ir.VectorType(ir.IntType(16), _LANES)
        with cgutils.for_range(builder, count) as loop:
            w = loop.index
            codes = window_codes(builder, builder.add(params, builder.mul(w, _I64(72))), row, (nibbles, highs))
            for k in range(64 // _LANES):
                column = builder.add(builder.mul(w, _I64(64)), _I64(_LANES * k))
                group = builder.lshr(column, shift)
                at = builder.mul(group, _I64(2))
                scale = widen_halves(builder, builder.load(pointer(builder, builder.add(scales, at), _I16)))
                offset = widen_halves(builder, builder.load(pointer(builder, builder.add(biases, at), _I16)))
                lanes = ir.Constant(ir.VectorType(_I32, _LANES), list(range(_LANES * k, _LANES * (k + 1))))
                part = builder.shuffle_vector(codes, codes, lanes)
                values = builder.uitofp(part, floats_t)
                scaled = builder.fmul(values, broadcast(builder, scale, _LANES))
                values = builder.fadd(scaled, broadcast(builder, offset, _LANES))
                target = builder.add(out, builder.mul(column, _I64(2)))
                builder.store(_to_bf16(builder, values), pointer(builder, target, halves_t), align=2)
        return context.get_dummy_value()

    return sig, codegen


_row_to_bf16: Any = intrinsic(_row_to_bf16_typing)


@numba.njit(cache=True, nogil=True)
def rows_apply(bits: int, columns: int, group_size: int) -> bool:
    """Whether rows_to_bf16 reads these codes: int8_windows' layouts with a power-of-two group size."""
    return windows_apply(bits, columns, group_size) and group_size & (group_size - 1) == 0


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def rows_to_bf16(data, scales, biases, first, count, bits, columns, groups, params, out):  # noqa: ANN001, ANN202
    """`out[j]` = rows first + j (j < count) of a packed segment (flat `data`, `scales`, `biases`) as
    bfloat16 bits (uint16); rows_apply must hold. `params`: int8_windows.window_params(bits, columns)."""
    per_row = data.shape[0] // (scales.shape[0] // groups)
    size = columns // groups
    shift = np.int64(0)
    while (1 << shift) < size:
        shift += 1
    nibble_mask, high_mask = (255, 0) if bits == 8 else (15, (1 << (bits - 4)) - 1)
    windows = np.int64(columns // 64)
    for j in range(count):
        row = first + j
        _row_to_bf16(
            np.int64(params.ctypes.data),
            windows,
            np.int64(data.ctypes.data) + np.int64(row) * per_row,
            np.int64(scales.ctypes.data) + np.int64(row) * groups * 2,  # float16 bits
            np.int64(biases.ctypes.data) + np.int64(row) * groups * 2,
            shift,
            np.int64(out.ctypes.data) + np.int64(j) * out.shape[1] * 2,
            nibble_mask,
            high_mask,
        )
    # The arrays read through addresses stay alive to here (numba frees an array after its last use).
    return params.shape[0] + data.shape[0] + scales.shape[0] + biases.shape[0] + out.shape[0]
