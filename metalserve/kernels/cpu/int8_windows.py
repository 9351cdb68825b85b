"""Four to eight decode rows dotted in integers at once: each 64-column window's codes built once, then dotted
with every input row's int8 codes (`vpdpbusd`), the lanes kept in float accumulators, not summed per block.

int8_dot.py sums each block's integer dot to a scalar as it goes: cheap for one input row, but with four to
eight rows (a step of that many decode requests) the codes would be rebuilt and the sums reduced once per
row. Here a window's codes (4, 5, 6 or 8 bits, in packed_codes.py's layout) are built once and every row's
`vpdpbusd` lanes are converted to float, scaled by the lane's weight group scale times its input block
scale, and added into that row's 16-lane accumulator, held in a register across the output's windows; one
horizontal sum per output and row at the end. llama.cpp's int8 kernels keep their partial sums the same
way. The offsets' term (each group's offset times the row's input sum over the group) is added once per
output, 16 groups a vector, not once per window and row: that cut a step of eight of the coder 0.5B from
95-99 to 75-80 ms (bench/cpu_decode_profile.py, the two trees alternated). Each window also prefetches a
cache line of the output four on (`prefetch`): in a decode step the weights come from memory, not the
caches.

A decode step of eight requests, the same tree with the flag off and on (bench/cpu_decode_profile.py
--requests 8, two threads): the default model (Q4_1, its Q8_0 head) 33.6 -> 28.7 ms; the coder 0.5B (Q5_0,
Q6_K, Q8_0 head) 93 ms with the previous form of this kernel (accumulators in memory, the offsets summed
per group afterwards, no prefetch, 4 and 8 bits on the float tile) -> 60 ms.

Where a window's bytes come from is the same for every row of a segment: `window_params` lists it per
window (the nibbles may straddle the half-row, the high bits two bit planes; masked loads read each part).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from metalserve.kernels.cpu.int8_dot import (
    has_vnni,
    llvm_function,
    masked_bytes,
    masked_load,
    pointer,
    prefetch,
    splat,
    widen_halves,
)

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
        dot = llvm_function(module, name, ir.FunctionType(lanes_t, [lanes_t] * 3))
        zero = ir.Constant(lanes_t, [0] * 16)
        return builder.call(dot, [zero, builder.bitcast(codes, lanes_t), builder.bitcast(x, lanes_t)])
    wide_t = ir.VectorType(i32, 64)
    products = builder.mul(builder.zext(codes, wide_t), builder.sext(x, wide_t))
    parts = [builder.shuffle_vector(products, products, ir.Constant(lanes_t, list(range(k, 64, 4)))) for k in range(4)]
    return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))


def window_codes(
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


_F32, _I64, _I16 = ir.FloatType(), ir.IntType(64), ir.IntType(16)
_FLOATS, _HALVES = ir.VectorType(_F32, 16), ir.VectorType(_I16, 16)
_BYTES = ir.VectorType(ir.IntType(8), 64)


def _per_lane(builder: ir.IRBuilder, groups_at: ir.Value, first_group: ir.Value, groups_per_window: int) -> ir.Value:
    """The window's group scales (float16 bits) from `groups_at`, as float32 spread over the 16 lanes."""
    group_t = ir.VectorType(_I16, groups_per_window)
    address = builder.add(groups_at, builder.mul(first_group, _I64(2)))
    values = widen_halves(builder, builder.load(pointer(builder, address, group_t), align=2))
    pattern = [lane * groups_per_window // 16 for lane in range(16)]
    return builder.shuffle_vector(values, values, ir.Constant(ir.VectorType(ir.IntType(32), 16), pattern))


def _window_step(builder: ir.IRBuilder, w: ir.Value, args: Any, accs: list[ir.Value], groups_per_window: int) -> None:
    """Window `w` of the output into each row's accumulator (`args`: the intrinsic's, see _output_accumulate)."""
    params_at, _, row_at, x_at, x_stride, ws_at, fg_at, xs_at, lanes_stride = args[:9]
    nibble_mask, high_mask, ahead, window_bytes = args[14:]
    offset = builder.mul(w, _I64(64))  # a window's 64 int8 codes, or its 16 float32 lane values
    prefetch(builder, builder.add(builder.add(row_at, ahead), builder.mul(w, window_bytes)))
    codes = window_codes(builder, builder.add(params_at, builder.mul(w, _I64(72))), row_at, (nibble_mask, high_mask))
    first_group = builder.load(builder.gep(pointer(builder, fg_at, _I64), [w]))
    weight_scales = _per_lane(builder, ws_at, first_group, groups_per_window)
    fmuladd = llvm_function(builder.module, "llvm.fmuladd.v16f32", ir.FunctionType(_FLOATS, [_FLOATS] * 3))
    for r, acc in enumerate(accs):
        x_address = builder.add(builder.add(x_at, offset), builder.mul(x_stride, _I64(r)))
        x = builder.load(pointer(builder, x_address, _BYTES), align=1)
        dots = builder.sitofp(_lane_dots(builder, codes, x), _FLOATS)
        lanes = builder.add(offset, builder.mul(lanes_stride, _I64(r)))
        input_scales = builder.load(pointer(builder, builder.add(xs_at, lanes), _FLOATS), align=4)
        builder.store(builder.call(fmuladd, [dots, builder.fmul(weight_scales, input_scales), builder.load(acc)]), acc)


def _add_offset_terms(builder: ir.IRBuilder, args: Any, accs: list[ir.Value]) -> None:
    """Each row's offset term into its accumulator: the output's group offsets dotted with the row's group
    sums of its dequantized input, 16 groups a vector (in the windows' loop it took an FMA a window and row)."""
    wb_at, groups, totals_at = args[9], args[10], args[11]
    fmuladd = llvm_function(builder.module, "llvm.fmuladd.v16f32", ir.FunctionType(_FLOATS, [_FLOATS] * 3))
    lanes = ir.Constant(ir.VectorType(ir.IntType(32), 16), list(range(16)))
    chunks = builder.udiv(builder.add(groups, _I64(15)), _I64(16))
    with cgutils.for_range(builder, chunks) as loop:
        first = builder.mul(loop.index, _I64(16))
        mask = builder.icmp_unsigned("<", lanes, splat(builder, builder.sub(groups, first), 16, 32))
        offset_bits = masked_load(builder, builder.add(wb_at, builder.mul(first, _I64(2))), mask, _HALVES)
        offsets = widen_halves(builder, offset_bits)  # masked-off lanes: 0 bits, 0.0
        for r, acc in enumerate(accs):
            row_at = builder.add(totals_at, builder.mul(builder.add(first, builder.mul(groups, _I64(r))), _I64(4)))
            builder.store(
                builder.call(fmuladd, [offsets, masked_load(builder, row_at, mask, _FLOATS), builder.load(acc)]), acc
            )


def _lane_sum(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """The sum of the 16 lanes, halving the vector four times."""
    for width in (8, 4, 2, 1):
        halves = [ir.Constant(ir.VectorType(ir.IntType(32), width), list(range(k, k + width))) for k in (0, width)]
        v = builder.fadd(builder.shuffle_vector(v, v, halves[0]), builder.shuffle_vector(v, v, halves[1]))
    return builder.extract_element(v, ir.IntType(32)(0))


def _output_accumulate(rows: int, groups_per_window: int) -> Any:
    """An intrinsic: one output of `rows` input rows over every window. Each row's 16-lane accumulator is an
    alloca LLVM keeps in a register across the windows' loop; it takes the lanes' dots times (weight group
    scale x input block scale), is summed to the output once, at the end, and the offset term added then.

    (params_at, windows, row_at, x_at, x_stride, weight_scales_at, first_group_at, lane_scales_at,
    lanes_stride, weight_offsets_at, groups, group_totals_at, out_at, out_stride, nibble mask, high mask,
    ahead, window_bytes): window_params, the number of windows, the output row's codes, the first input row's
    int8 codes (the next rows `x_stride` bytes on), the output row's weight scales (float16 bits), each
    window's first group (int64), the first row's lane input scales (16 float32 a window; the next rows
    `lanes_stride` bytes on), the output row's weight offsets (float16 bits) and their number, the rows' sums
    of their dequantized input per group (`[rows, groups]` float32, see group_totals), the first row's output
    (the next rows `out_stride` bytes on), how far on (bytes) the codes to prefetch lie, and a window's share
    of a row's bytes: window w asks for the line `ahead + w * window_bytes` on, so the windows of one output
    ask for a later output's whole row."""

    @intrinsic
    def accumulate(
        typingctx: Any,
        params_at: Any,
        windows: Any,
        row_at: Any,
        x_at: Any,
        x_stride: Any,
        weight_scales_at: Any,
        first_group_at: Any,
        lane_scales_at: Any,
        lanes_stride: Any,
        weight_offsets_at: Any,
        groups: Any,
        group_totals_at: Any,
        out_at: Any,
        out_stride: Any,
        nibble_mask: Any,
        high_mask: Any,
        ahead: Any,
        window_bytes: Any,
    ) -> Any:
        addresses = (params_at, windows, row_at, x_at, x_stride, weight_scales_at, first_group_at)
        lanes = (lane_scales_at, lanes_stride, weight_offsets_at, groups, group_totals_at, out_at, out_stride)
        sig = types.void(*addresses, *lanes, nibble_mask, high_mask, ahead, window_bytes)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            zero = ir.Constant(_FLOATS, [0.0] * 16)
            accs = [cgutils.alloca_once_value(builder, zero) for _ in range(rows)]
            with cgutils.for_range(builder, args[1]) as loop:
                _window_step(builder, loop.index, args, accs, groups_per_window)
            _add_offset_terms(builder, args, accs)
            out_at, out_stride = args[12], args[13]
            for r, acc in enumerate(accs):
                address = builder.add(out_at, builder.mul(out_stride, _I64(r)))
                builder.store(_lane_sum(builder, builder.load(acc)), pointer(builder, address, _F32), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return accumulate


_FOUR = {g: _output_accumulate(4, g) for g in (1, 2, 4)}
_EIGHT = {g: _output_accumulate(8, g) for g in (1, 2, 4)}
_four_1, _four_2, _four_4 = _FOUR[1], _FOUR[2], _FOUR[4]
_eight_1, _eight_2, _eight_4 = _EIGHT[1], _EIGHT[2], _EIGHT[4]


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False, inline="always")
def _output(count, per_window, args):  # noqa: ANN001, ANN202
    """The intrinsic for `count` rows (8, else 4) and `per_window` groups a window (1, 2 or 4); `args`
    its 18 arguments."""
    if count == 8:
        if per_window == 4:
            _eight_4(*args)
        elif per_window == 2:
            _eight_2(*args)
        else:
            _eight_1(*args)
    elif per_window == 4:
        _four_4(*args)
    elif per_window == 2:
        _four_2(*args)
    else:
        _four_1(*args)


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def lane_scales(xscale):  # noqa: ANN001, ANN202
    """`[rows, columns / 4]`: each vpdpbusd lane's input block scale (lane l of window w: block 2w + l // 8)."""
    rows, blocks = xscale.shape
    scales = np.empty((rows, blocks * 8), np.float32)
    for r in range(rows):
        for k in range(blocks * 8):
            scales[r, k] = xscale[r, k >> 3]
    return scales


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def group_totals(xtotal, xtotal16, r0, count, size):  # noqa: ANN001, ANN202
    """`[count, columns / size]`: rows r0 to r0 + count's sums of their dequantized input over each weight
    group of `size` columns (from quantize_row's block and half-block sums)."""
    per_group = size // 32
    groups = xtotal.shape[1] * 32 // size
    totals = np.empty((count, groups), np.float32)
    for r in range(count):
        for g in range(groups):
            if size < 32:
                totals[r, g] = xtotal16[r0 + r, g]
            else:
                s = np.float32(0.0)
                for b in range(g * per_group, (g + 1) * per_group):
                    s += xtotal[r0 + r, b]
                totals[r, g] = s
    return totals


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def int8_window_rows(
    xq, xs16, xtotal, xtotal16, codes2, scales2, biases2, bits, params, r0, count, o_lo, o_hi, out, at
):  # noqa: ANN001, ANN202
    """`out[r, at + o] = x_r . w[o]` for input rows r0 <= r < r0 + count (4 or 8) and outputs
    o_lo <= o < o_hi of one segment; `xq`: the rows quantized (int8_dot.quantize_row), `xtotal` and
    `xtotal16` their block and half-block sums; `xs16`: their lane scales (lane_scales); `params`:
    window_params(bits, columns). `out` must be float32 and C-ordered (the intrinsic writes it through an
    address)."""
    columns = xq.shape[1]
    groups = scales2.shape[1]
    size = columns // groups
    per_window = 64 // size if size < 64 else 1
    nibble_mask, high_mask = (255, 0) if bits == 8 else (15, (1 << (bits - 4)) - 1)
    first_group = np.empty(columns // 64, np.int64)  # each window's first group (no division in the loop)
    for w in range(columns // 64):
        first_group[w] = (64 * w) // size
    totals = group_totals(xtotal, xtotal16, r0, count, size)
    x_at = np.int64(xq.ctypes.data) + np.int64(r0) * columns
    lanes_stride = np.int64(xs16.shape[1] * 4)
    xs_at = np.int64(xs16.ctypes.data) + np.int64(r0) * lanes_stride
    out_stride = np.int64(out.shape[1] * 4)
    out_at = np.int64(out.ctypes.data) + np.int64(r0) * out_stride + np.int64(at) * 4
    params_at, windows, first_group_at = (
        np.int64(params.ctypes.data),
        np.int64(columns // 64),
        np.int64(first_group.ctypes.data),
    )
    ahead = np.int64(codes2.shape[1]) * 4  # the codes of the output four on, prefetched window by window
    for o in range(o_lo, o_hi):
        row_at = np.int64(codes2.ctypes.data) + np.int64(o) * codes2.shape[1]
        ws_at = np.int64(scales2.ctypes.data) + np.int64(o) * groups * 2  # float16 bits
        wb_at = np.int64(biases2.ctypes.data) + np.int64(o) * groups * 2
        args = (
            params_at,
            windows,
            row_at,
            x_at,
            np.int64(columns),
            ws_at,
            first_group_at,
            xs_at,
            lanes_stride,
            wb_at,
            np.int64(groups),
            np.int64(totals.ctypes.data),
            out_at + np.int64(o) * 4,
            out_stride,
            nibble_mask,
            high_mask,
            ahead,
            np.int64(codes2.shape[1]) // windows,
        )
        _output(count, per_window, args)
    # The arrays read through addresses stay alive to here (numba frees an array after its last use).
    return first_group.shape[0] + xs16.shape[0] + totals.shape[0] + xq.shape[0]
