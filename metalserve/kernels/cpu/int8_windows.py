"""Four to eight decode rows dotted in integers at once: each 64-column window's codes built once, then dotted
with every input row's int8 codes (`vpdpbusd`), the lanes kept in float accumulators, not summed per block.

int8_dot.py sums each block's integer dot to a scalar as it goes: cheap for one input row, but with four to
eight rows (a step of that many decode requests) the codes would be rebuilt and the sums reduced once per
row, and the float kernel's four-row tile wins. Here a window's codes (4, 5, 6 or 8 bits, in
packed_codes.py's layout) are built once and every row's `vpdpbusd` lanes are converted to float, scaled by
the lane's weight group scale times its input block scale and added into that row's 16-lane accumulator; one
horizontal sum per output and row at the end. llama.cpp's int8 kernels keep their partial sums the same way.
Eight rows against the float tile (bench/cpu_int8_dot.py --tokens 8, one thread; two): the coder 0.5B's
Q5_0 gate/up 0.72x its time (0.70x), its Q6_K down 0.77x (0.85x); 4-bit codes took 1.1x and 8-bit ones 1.2x,
so packed_linear keeps the tile for those (the kernel reads them all, and the tests hold it to that).

Where a window's bytes come from is the same for every row of a segment: `window_params` lists it per
window (the nibbles may straddle the half-row, the high bits two bit planes; masked loads read each part).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from metalserve.kernels.cpu.int8_dot import has_vnni, masked_bytes, splat

MIN_ROWS, MAX_ROWS = 4, 8  # the steps this kernel serves: fewer take int8_dot's, more the float tile
# window_params columns: nibble bytes (offset in the row, the first `split` lanes, their shift; the rest
# from the second offset, high nibbles), high bits (offset, lanes, shift; the rest's offset and shift).
NIBBLE_A, NIBBLE_B, NIBBLE_SPLIT, NIBBLE_SHIFT, HIGH_A, HIGH_B, HIGH_SPLIT, HIGH_SHIFT_A, HIGH_SHIFT_B = range(9)


@numba.njit(cache=True, nogil=True)
def windows_apply(bits: int, columns: int, group_size: int) -> bool:
    """Whether int8_window_rows reads codes of `bits` over `columns` in groups of `group_size`: whole
    windows, each inside at most two bit planes, groups of 16, 32 or a multiple of 64."""
    if bits not in (4, 5, 6, 8) or columns % 64 or (group_size not in (16, 32) and group_size % 64):
        return False
    return bits in (4, 8) or columns // (8 // (bits - 4)) >= 64


@numba.njit(cache=True, nogil=True)
def window_params(bits: int, columns: int) -> np.ndarray:
    """Per 64-column window, where its codes lie in a row (see the column names above)."""
    half = columns // 2
    width = bits - 4 if bits < 8 else 0
    span = columns // (8 // width) if width else columns
    params = np.zeros((columns // 64, 9), np.int64)
    for w in range(columns // 64):
        c = 64 * w
        p = params[w]
        if bits == 8 or c + 64 <= half:
            p[NIBBLE_A], p[NIBBLE_SPLIT] = c, 64
        elif c >= half:
            p[NIBBLE_A], p[NIBBLE_SPLIT], p[NIBBLE_SHIFT] = c - half, 64, 4
        else:  # low nibbles up to the half-row, then the same bytes' high nibbles from byte 0
            p[NIBBLE_A], p[NIBBLE_SPLIT] = c, half - c
        p[NIBBLE_B] = c - half
        if width:
            plane = c // span
            p[HIGH_A] = half + c - plane * span
            p[HIGH_B] = p[HIGH_A] - span
            p[HIGH_SPLIT] = min((plane + 1) * span - c, 64)
            p[HIGH_SHIFT_A], p[HIGH_SHIFT_B] = width * plane, width * (plane + 1)
        else:  # no high bits: a load of bytes that exist, masked to nothing below
            p[HIGH_A], p[HIGH_B], p[HIGH_SPLIT] = p[NIBBLE_A], p[NIBBLE_A], 64
    return params


def _lane_dots(builder: ir.IRBuilder, codes: ir.Value, x: ir.Value) -> ir.Value:
    """16 int32 lanes, lane l the dot of bytes 4l..4l+3 of the unsigned `codes` and the signed `x`."""
    i32 = ir.IntType(32)
    lanes_t = ir.VectorType(i32, 16)
    if has_vnni():
        name = "llvm.x86.avx512.vpdpbusd.512"
        module = builder.module
        dot = module.globals.get(name) or ir.Function(module, ir.FunctionType(lanes_t, [lanes_t] * 3), name=name)
        zero = ir.Constant(lanes_t, [0] * 16)
        return builder.call(dot, [zero, builder.bitcast(codes, lanes_t), builder.bitcast(x, lanes_t)])
    wide_t = ir.VectorType(i32, 64)
    products = builder.mul(builder.zext(codes, wide_t), builder.sext(x, wide_t))
    parts = [builder.shuffle_vector(products, products, ir.Constant(lanes_t, list(range(k, 64, 4)))) for k in range(4)]
    return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))


def _window_codes(
    builder: ir.IRBuilder, params_at: ir.Value, row_at: ir.Value, masks: tuple[ir.Value, ir.Value]
) -> ir.Value:
    """The window's 64 codes as bytes, from the row at `row_at` as its window_params row says."""
    i64 = ir.IntType(64)
    bytes_t = ir.VectorType(ir.IntType(8), 64)
    words_t = ir.VectorType(ir.IntType(16), 32)
    params = builder.inttoptr(params_at, i64.as_pointer())
    p = [builder.load(builder.gep(params, [i64(k)])) for k in range(9)]
    lanes = ir.Constant(bytes_t, list(range(64)))

    def part(offset: ir.Value, first: ir.Value, before: bool, shift: ir.Value) -> ir.Value:
        """The bytes at row offset `offset` in the lanes before (or from) `first`, shifted right by `shift`
        as 16-bit lanes (x86 has no byte shift; what the next byte brings in is masked off after)."""
        chosen = builder.icmp_unsigned("<" if before else ">=", lanes, splat(builder, first, 64))
        loaded = masked_bytes(builder, builder.add(row_at, offset), chosen)
        shifted = builder.lshr(builder.bitcast(loaded, words_t), splat(builder, shift, 32, 16))
        return builder.bitcast(shifted, bytes_t)

    nibble_mask, high_mask = masks
    four = ir.Constant(i64, 4)
    nibbles = builder.or_(
        part(p[NIBBLE_A], p[NIBBLE_SPLIT], True, p[NIBBLE_SHIFT]), part(p[NIBBLE_B], p[NIBBLE_SPLIT], False, four)
    )
    nibbles = builder.and_(nibbles, splat(builder, nibble_mask, 64))
    high = builder.or_(
        part(p[HIGH_A], p[HIGH_SPLIT], True, p[HIGH_SHIFT_A]), part(p[HIGH_B], p[HIGH_SPLIT], False, p[HIGH_SHIFT_B])
    )
    high = builder.and_(high, splat(builder, high_mask, 64))
    high = builder.bitcast(builder.shl(builder.bitcast(high, words_t), ir.Constant(words_t, [4] * 32)), bytes_t)
    return builder.or_(nibbles, high)


def _window_accumulate(rows: int, groups_per_window: int) -> Any:
    """An intrinsic: one window of one output row against `rows` input rows, into their accumulators.

    (params_at, row_at, x_at, x_stride, weight_scales_at, x_scales_at, x_scales_stride, acc_at, nibble
    mask, high mask): the window's window_params row, the output row's codes, the first input row's int8
    codes at the window (the next rows `x_stride` bytes on), the weight scales of the window's first group,
    the first row's 16 lane input scales (the next rows `x_scales_stride` bytes on), and `rows` x 16 float32
    accumulators."""
    f32 = ir.FloatType()
    floats_t = ir.VectorType(f32, 16)
    bytes_t = ir.VectorType(ir.IntType(8), 64)

    @intrinsic
    def accumulate(
        typingctx: Any,
        params_at: Any,
        row_at: Any,
        x_at: Any,
        x_stride: Any,
        weight_scales_at: Any,
        x_scales_at: Any,
        x_scales_stride: Any,
        acc_at: Any,
        nibble_mask: Any,
        high_mask: Any,
    ) -> Any:
        arguments = (params_at, row_at, x_at, x_stride, weight_scales_at, x_scales_at, x_scales_stride, acc_at)
        sig = types.void(*arguments, nibble_mask, high_mask)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            params_at, row_at, x_at, x_stride, ws_at, xs_at, xs_stride, acc_at, nibble_mask, high_mask = args
            codes = _window_codes(builder, params_at, row_at, (nibble_mask, high_mask))
            group_t = ir.VectorType(f32, groups_per_window)
            group_scales = builder.load(builder.inttoptr(ws_at, group_t.as_pointer()), align=4)
            pattern = [lane * groups_per_window // 16 for lane in range(16)]
            lane_scales = builder.shuffle_vector(
                group_scales, group_scales, ir.Constant(ir.VectorType(ir.IntType(32), 16), pattern)
            )
            fmuladd_t = ir.FunctionType(floats_t, [floats_t] * 3)
            name = "llvm.fmuladd.v16f32"
            fmuladd = builder.module.globals.get(name) or ir.Function(builder.module, fmuladd_t, name=name)
            for r in range(rows):
                step = ir.Constant(ir.IntType(64), r)
                x = builder.load(
                    builder.inttoptr(builder.add(x_at, builder.mul(x_stride, step)), bytes_t.as_pointer()), align=1
                )
                dots = builder.sitofp(_lane_dots(builder, codes, x), floats_t)
                xs_pointer = builder.inttoptr(builder.add(xs_at, builder.mul(xs_stride, step)), floats_t.as_pointer())
                scales = builder.fmul(lane_scales, builder.load(xs_pointer, align=4))
                acc_pointer = builder.inttoptr(
                    builder.add(acc_at, ir.Constant(ir.IntType(64), 64 * r)), floats_t.as_pointer()
                )
                builder.store(
                    builder.call(fmuladd, [dots, scales, builder.load(acc_pointer, align=4)]), acc_pointer, align=4
                )
            return context.get_dummy_value()

        return sig, codegen

    return accumulate


_FOUR = {g: _window_accumulate(4, g) for g in (1, 2, 4)}
_EIGHT = {g: _window_accumulate(8, g) for g in (1, 2, 4)}
_four_1, _four_2, _four_4 = _FOUR[1], _FOUR[2], _FOUR[4]
_eight_1, _eight_2, _eight_4 = _EIGHT[1], _EIGHT[2], _EIGHT[4]


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False, inline="always")
def _window(count, per_window, params_at, row_at, x_at, x_stride, ws_at, xs_at, xs_stride, acc_at, nmask, hmask):  # noqa: ANN001, ANN202
    """The intrinsic for `count` rows (8, else 4) and `per_window` groups a window (1, 2 or 4)."""
    if count == 8:
        if per_window == 4:
            _eight_4(params_at, row_at, x_at, x_stride, ws_at, xs_at, xs_stride, acc_at, nmask, hmask)
        elif per_window == 2:
            _eight_2(params_at, row_at, x_at, x_stride, ws_at, xs_at, xs_stride, acc_at, nmask, hmask)
        else:
            _eight_1(params_at, row_at, x_at, x_stride, ws_at, xs_at, xs_stride, acc_at, nmask, hmask)
    elif per_window == 4:
        _four_4(params_at, row_at, x_at, x_stride, ws_at, xs_at, xs_stride, acc_at, nmask, hmask)
    elif per_window == 2:
        _four_2(params_at, row_at, x_at, x_stride, ws_at, xs_at, xs_stride, acc_at, nmask, hmask)
    else:
        _four_1(params_at, row_at, x_at, x_stride, ws_at, xs_at, xs_stride, acc_at, nmask, hmask)


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def lane_scales(xscale):  # noqa: ANN001, ANN202
    """`[rows, columns / 4]`: each vpdpbusd lane's input block scale (lane l of window w: block 2w + l // 8)."""
    rows, blocks = xscale.shape
    out = np.empty((rows, blocks * 8), np.float32)
    for r in range(rows):
        for k in range(blocks * 8):
            out[r, k] = xscale[r, k >> 3]
    return out


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def int8_window_rows(xq, xs16, total16, codes2, scales2, biases2, bits, params, r0, count, o_lo, o_hi, out, at):  # noqa: ANN001, ANN202
    """`out[r, at + o] = x_r . w[o]` for input rows r0 <= r < r0 + count (4 or 8) and outputs
    o_lo <= o < o_hi of one segment; `xq`, `xs16`, `total16`: the rows quantized (int8_dot.quantize_row),
    their lane scales (lane_scales), their sums per 16 columns; `params`: window_params(bits, columns)."""
    columns = xq.shape[1]
    groups = scales2.shape[1]
    size = columns // groups
    per_window = 64 // size if size < 64 else 1
    nibble_mask, high_mask = (255, 0) if bits == 8 else (15, (1 << (bits - 4)) - 1)
    totals = np.zeros((count, groups), np.float32)  # each row's input sum per group (the offsets' factor)
    for r in range(count):
        for p in range(columns // 16):
            totals[r, p * 16 // size] += total16[r0 + r, p]
    acc = np.zeros(16 * count, np.float32)
    acc_at = np.int64(acc.ctypes.data)
    x_at = np.int64(xq.ctypes.data) + np.int64(r0) * columns
    xs_at = np.int64(xs16.ctypes.data) + np.int64(r0) * xs16.shape[1] * 4
    params_at = np.int64(params.ctypes.data)
    ws_base = np.int64(scales2.ctypes.data)
    first_group = np.empty(columns // 64, np.int64)  # each window's first group (no division in the loop)
    for w in range(columns // 64):
        first_group[w] = (64 * w) // size
    for o in range(o_lo, o_hi):
        row_at = np.int64(codes2.ctypes.data) + np.int64(o) * codes2.shape[1]
        acc[:] = 0
        for w in range(columns // 64):
            ws_at = ws_base + (np.int64(o) * groups + first_group[w]) * 4
            _window(
                count,
                per_window,
                params_at + 72 * w,
                row_at,
                x_at + 64 * w,
                columns,
                ws_at,
                xs_at + 64 * w,
                xs16.shape[1] * 4,
                acc_at,
                nibble_mask,
                high_mask,
            )
        for r in range(count):
            total = np.float32(0.0)
            for lane in range(16):
                total += acc[16 * r + lane]
            for g in range(groups):
                total += biases2[o, g] * totals[r, g]
            out[r0 + r, at + o] = total
