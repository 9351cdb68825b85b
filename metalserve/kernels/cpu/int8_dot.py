"""Decode rows dotted in integers: the input quantized to int8 per block of 32, the codes read as bytes.

llama.cpp's speed at one stream comes from this: each block of 32 weight codes is dotted with the int8
input in integers, 64 byte pairs per AVX-512 VNNI instruction (`vpdpbusd`), and scaled once a block,
where the float path dequantizes every weight first. numba's own integer arithmetic widens to int64 and
never reaches that instruction, so the chunk dot is written in LLVM IR (`numba.extending.intrinsic`):
`llvm.x86.avx512.vpdpbusd.512`/`.256` where the CPU has VNNI (checked when the IR is built; numba's cache
is keyed on the CPU), else plain vector IR that any target lowers. A block's integer sum is scaled by the
weight's and the input's scales; the offset term takes the quantized input's block sums, so a group's
result is exactly the integer dot of what was quantized.

The error is the int8 input's (relative ~5e-3 on a random matvec, as llama.cpp's Q8 activations), so it is
a choice: `--cpu-int8-activations` (docs/cpu-path.md). Codes read here: 4 bits whose half-rows hold whole
groups of 32 and 8 bits with groups of 32 (int8_rows: a block's dot is a group's), and 4, 5 and 6 bits in
groups of 16 or multiples of 32 over rows of a multiple of 128 columns (int8_plane_rows: a 64-column window
at a time, its nibbles from one half-row and its high bits from packed_codes.py's bit planes, which need
not start at a window: masked loads read the two planes a window may reach into); every other layout keeps
the float kernel. Both ask for the codes, scales and offsets of the output PREFETCH_AHEAD rows on while
they dot one (`prefetch_rows`): a decode step at one request (bench/cpu_decode_profile.py, two threads,
the flag on) went from 10.1 to 8.0 ms on the default model and from 43.7 to 31 ms on the coder 0.5B.
"""

from __future__ import annotations

import os
from typing import Any

import numba
import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.extending import intrinsic

LOW, HIGH, BYTE = 0, 1, 2  # which part of each code byte a chunk's dot reads
MODES = ("auto", "on", "off")
# How rank 0 hands the resolved mode to the local ranks it starts (distributed/launch.py copies its
# environment into theirs; serving/pipeline.main reads it back).
RANKS_ENV = "METALSERVE_RANKS_CPU_INT8_ACTIVATIONS"
_state = {"on": False}


def has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI (with VL, for the 32-byte form)."""
    features = binding.get_host_cpu_features()
    return bool(features.get("avx512vnni")) and bool(features.get("avx512vl"))


def set_mode(mode: str) -> bool:
    """`--cpu-int8-activations`: `on`, `off`, or `auto` (on where the CPU has VNNI). Returns the result.
    Read when a projection's segments are built (at load), so set it before loading models."""
    if mode not in MODES:
        raise ValueError(f"--cpu-int8-activations takes one of {', '.join(MODES)}, not {mode!r}")
    _state["on"] = mode == "on" or (mode == "auto" and has_vnni())
    os.environ[RANKS_ENV] = "on" if _state["on"] else "off"
    return _state["on"]


def enabled() -> bool:
    return _state["on"]


def _block_sums(builder: ir.IRBuilder, chosen: ir.Value, x: ir.Value, width: int, block: int = 32) -> list[ir.Value]:
    """The int32 dot of each `block`-byte piece of the `width` chosen code bytes (unsigned) with `x` (signed)."""
    i32 = ir.IntType(32)
    module = builder.module
    if has_vnni():
        lanes_t = ir.VectorType(i32, width // 4)
        name = f"llvm.x86.avx512.vpdpbusd.{width * 8}"
        dot = llvm_function(module, name, ir.FunctionType(lanes_t, [lanes_t] * 3))
        zero = ir.Constant(lanes_t, [0] * (width // 4))
        sums = builder.call(dot, [zero, builder.bitcast(chosen, lanes_t), builder.bitcast(x, lanes_t)])
        per_block = block // 4
    else:
        wide_t = ir.VectorType(i32, width)
        sums = builder.mul(builder.zext(chosen, wide_t), builder.sext(x, wide_t))
        per_block = block
    block_t = ir.VectorType(i32, per_block)
    name = f"llvm.vector.reduce.add.v{per_block}i32"
    reduce = llvm_function(module, name, ir.FunctionType(i32, [block_t]))
    out = []
    for b in range(width // block):
        pick = ir.Constant(ir.VectorType(i32, per_block), list(range(per_block * b, per_block * (b + 1))))
        out.append(builder.call(reduce, [builder.shuffle_vector(sums, sums, pick)]))
    return out


def _chunk_dot(width: int) -> Any:
    """An intrinsic: (codes address, int8 input address, part) -> the int32 dots of each 32-byte block
    of a `width`-byte chunk (a tuple of width // 32)."""

    @intrinsic
    def chunk_dot(typingctx: Any, codes: Any, xq: Any, part: Any) -> Any:
        sig = types.UniTuple(types.int32, width // 32)(codes, xq, part)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            bytes_t = ir.VectorType(ir.IntType(8), width)
            raw = builder.load(builder.inttoptr(args[0], bytes_t.as_pointer()), align=1)
            x = builder.load(builder.inttoptr(args[1], bytes_t.as_pointer()), align=1)
            low = builder.and_(raw, ir.Constant(bytes_t, [15] * width))
            high = builder.lshr(raw, ir.Constant(bytes_t, [4] * width))
            part = args[2]
            is_low = builder.icmp_signed("==", part, ir.Constant(part.type, LOW))
            is_high = builder.icmp_signed("==", part, ir.Constant(part.type, HIGH))
            chosen = builder.select(is_low, low, builder.select(is_high, high, raw))
            return context.make_tuple(builder, signature.return_type, _block_sums(builder, chosen, x, width))

        return sig, codegen

    return chunk_dot


_dot64 = _chunk_dot(64)
_dot32 = _chunk_dot(32)


def llvm_function(module: ir.Module, name: str, fn_t: ir.FunctionType) -> ir.Function:
    """The LLVM intrinsic `name` in `module`, declared on first use."""
    found = module.globals.get(name)
    return found if found is not None else ir.Function(module, fn_t, name=name)


def splat(builder: ir.IRBuilder, value: ir.Value, width: int, bits: int = 8) -> ir.Value:
    """A vector of `width` copies of the integer `value`, as `bits`-bit integers."""
    lane = ir.IntType(bits)
    value = builder.trunc(value, lane) if value.type.width > bits else value
    return broadcast(builder, value, width)


def broadcast(builder: ir.IRBuilder, value: ir.Value, width: int) -> ir.Value:
    """A vector of `width` copies of `value`, of its own type."""
    vector_t = ir.VectorType(value.type, width)
    one = builder.insert_element(ir.Constant(vector_t, None), value, ir.IntType(32)(0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(ir.IntType(32), width), [0] * width))


_HALF = ir.HalfType()


def widen_halves(builder: ir.IRBuilder, bits: ir.Value) -> ir.Value:
    """float16 values given as their i16 bits (a scalar or a vector) as float32: one `vcvtph2ps` where the
    CPU has F16C (every x86-64 since 2012) or the target converts natively (arm64)."""
    vector = isinstance(bits.type, ir.VectorType)
    half_t = ir.VectorType(_HALF, bits.type.count) if vector else _HALF
    float_t = ir.VectorType(ir.FloatType(), bits.type.count) if vector else ir.FloatType()
    return builder.fpext(builder.bitcast(bits, half_t), float_t)


def _half_to_float_typing(typingctx: Any, bits: Any) -> Any:
    """A float16 given as its uint16 bits (numba has no float16 type) as float32: packed codes' scales."""
    sig = types.float32(types.uint16)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        return widen_halves(builder, args[0])

    return sig, codegen


half_to_float: Any = intrinsic(_half_to_float_typing)


def pointer(builder: ir.IRBuilder, address: ir.Value, pointee: ir.Type) -> ir.Value:
    """The int64 `address` as a pointer to `pointee`."""
    return builder.inttoptr(address, pointee.as_pointer())


def masked_load(builder: ir.IRBuilder, address: ir.Value, mask: ir.Value, vector_t: ir.VectorType) -> ir.Value:
    """A `vector_t` from `address` (an int64) where `mask` is set, 0 elsewhere; the lanes outside it are
    never read."""
    element = vector_t.element
    kind = "f32" if isinstance(element, ir.FloatType) else f"i{element.width}"
    name = f"llvm.masked.load.v{vector_t.count}{kind}.p0v{vector_t.count}{kind}"
    mask_t = ir.VectorType(ir.IntType(1), vector_t.count)
    fn_t = ir.FunctionType(vector_t, [vector_t.as_pointer(), ir.IntType(32), mask_t, vector_t])
    load = llvm_function(builder.module, name, fn_t)
    align = 4 if kind == "f32" else 1
    zeros = ir.Constant(vector_t, [0] * vector_t.count)
    return builder.call(load, [pointer(builder, address, vector_t), ir.IntType(32)(align), mask, zeros])


def masked_bytes(builder: ir.IRBuilder, address: ir.Value, mask: ir.Value) -> ir.Value:
    """64 bytes from `address` where `mask` is set, 0 elsewhere; the bytes outside it are never read."""
    return masked_load(builder, address, mask, ir.VectorType(ir.IntType(8), 64))


def prefetch(builder: ir.IRBuilder, address: ir.Value) -> None:
    """Ask for the cache line at `address` (an int64) to be read into every cache level. In a decode step
    the weights come from the last level or memory (a step reads them all once), and the hardware's
    prefetchers did not run far enough ahead: the default model's 8-row head took 4.2 ms in a step (3.4
    ms run alone, its 35 MB in cache); asking for a later output's codes while this one's are dotted
    brought it to 2.7-3.1 ms (int8_windows.py)."""
    name = "llvm.prefetch.p0i8"
    i32 = ir.IntType(32)
    fn_t = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32])
    fn = llvm_function(builder.module, name, fn_t)
    # read (0), keep in all levels (3), data (1)
    builder.call(fn, [builder.inttoptr(address, ir.IntType(8).as_pointer()), i32(0), i32(3), i32(1)])


def _line_prefetch() -> Any:
    """An intrinsic: `prefetch` of the line at an int64 address, for numba code."""

    @intrinsic
    def prefetch_line(typingctx: Any, address: Any) -> Any:
        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            prefetch(builder, args[0])
            return context.get_dummy_value()

        return types.void(address), codegen

    return prefetch_line


prefetch_line = _line_prefetch()


# Outputs ahead of the one being dotted whose codes, scales and offsets are asked for.
PREFETCH_AHEAD = 4


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False, inline="always")
def prefetch_rows(codes2, scales2, biases2, o):  # noqa: ANN001, ANN202
    """Ask for row `o + PREFETCH_AHEAD`'s codes, scales and offsets (past the last row: nothing)."""
    ahead = o + PREFETCH_AHEAD
    if ahead < codes2.shape[0]:
        prefetch_row(codes2, ahead)
        prefetch_row(scales2, ahead)
        prefetch_row(biases2, ahead)


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False, inline="always")
def prefetch_row(array, row):  # noqa: ANN001, ANN202
    """Ask for every line of row `row` of a 2-D `array` whose rows are contiguous."""
    start = np.int64(array.ctypes.data) + np.int64(row) * array.strides[0]
    for line in range(0, array.shape[1] * array.itemsize, 64):
        prefetch_line(start + line)


def _window_dot(block: int) -> Any:
    """An intrinsic: the int32 dots of each `block` columns of a 64-column window of 4-, 5- or 6-bit codes
    (packed_codes.py's layout) with the int8 input (a tuple of 64 // block).

    Arguments: the window's nibble bytes' address and shift; its high bits' tail bytes, which may come from
    two bit planes (a plane's columns need not start at a window): the first `split` columns' at address
    a >> shift a, the rest's at address b >> shift b; the high bits' mask (0 for 4-bit codes); the input's
    address. Each code is `(nibble >> shift) & 15 | ((high >> plane shift) & mask) << 4`."""

    @intrinsic
    def window_dot(
        typingctx: Any,
        nibbles: Any,
        nibble_shift: Any,
        high_a: Any,
        shift_a: Any,
        high_b: Any,
        shift_b: Any,
        split: Any,
        high_mask: Any,
        xq: Any,
    ) -> Any:
        arguments = (nibbles, nibble_shift, high_a, shift_a, high_b, shift_b, split, high_mask, xq)
        sig = types.UniTuple(types.int32, 64 // block)(*arguments)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            bytes_t = ir.VectorType(ir.IntType(8), 64)
            nibble_at, nibble_shift, a_at, shift_a, b_at, shift_b, split, high_mask, x_at = args
            load = lambda at: builder.load(builder.inttoptr(at, bytes_t.as_pointer()), align=1)  # noqa: E731
            # Shifts of 16-bit lanes: x86 has no byte shift, and the bits one brings in from the next byte
            # are masked off below (shifts of at most 7, masks of at most 2 bits).
            words_t = ir.VectorType(ir.IntType(16), 32)

            def shift_right(value: ir.Value, amount: ir.Value) -> ir.Value:
                words = builder.lshr(builder.bitcast(value, words_t), splat(builder, amount, 32, 16))
                return builder.bitcast(words, bytes_t)

            nibble = builder.and_(shift_right(load(nibble_at), nibble_shift), ir.Constant(bytes_t, [15] * 64))
            lanes = ir.Constant(bytes_t, list(range(64)))  # bytes, as 64 lanes of i32 took 4 compares
            first = builder.icmp_unsigned("<", lanes, splat(builder, split, 64))
            high_a = shift_right(masked_bytes(builder, a_at, first), shift_a)
            high_b = shift_right(masked_bytes(builder, b_at, builder.not_(first)), shift_b)
            high = builder.and_(builder.or_(high_a, high_b), splat(builder, high_mask, 64))
            high = builder.bitcast(builder.shl(builder.bitcast(high, words_t), ir.Constant(words_t, [4] * 32)), bytes_t)
            chosen = builder.or_(nibble, high)
            sums = _block_sums(builder, chosen, load(x_at), 64, block)
            return context.make_tuple(builder, signature.return_type, sums)

        return sig, codegen

    return window_dot


_window32 = _window_dot(32)
_window16 = _window_dot(16)


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def quantize_row(x, r, xq, scale, total, total16):  # noqa: ANN001, ANN202  (numba infers the types)
    """Row `r` of `x` to int8 per block of 32 (llama.cpp's Q8_0): the codes, each block's scale, and the
    sum of its dequantized codes (for the offset term), per block and per half-block (groups of 16)."""
    for b in range(x.shape[1] // 32):
        amax = np.float32(0.0)
        for k in range(32):
            amax = max(amax, abs(x[r, 32 * b + k]))
        d = amax / np.float32(127.0) if amax > 0 else np.float32(1.0)
        low, high = np.int64(0), np.int64(0)
        for k in range(32):
            q = np.int32(np.round(x[r, 32 * b + k] / d))
            xq[32 * b + k] = np.int8(q)
            if k < 16:
                low += q
            else:
                high += q
        scale[b], total[b] = d, np.float32(low + high) * d
        total16[2 * b], total16[2 * b + 1] = np.float32(low) * d, np.float32(high) * d


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def _row_blocks(codes2, o, xq, x_off, part, count, sums, first):  # noqa: ANN001, ANN202
    """The block dots of the first `count` code bytes of row `o` with `xq[x_off:]` into sums[first:].
    The arrays themselves are passed, not addresses: numba frees an array after its last use, and an
    address kept past that reads freed memory."""
    codes_at = np.int64(codes2.ctypes.data) + np.int64(o) * codes2.shape[1]
    x_at = np.int64(xq.ctypes.data) + x_off
    done = 0
    while done + 64 <= count:
        s0, s1 = _dot64(codes_at + done, x_at + done, part)
        sums[first + done // 32], sums[first + done // 32 + 1] = s0, s1
        done += 64
    if done < count:
        (s0,) = _dot32(codes_at + done, x_at + done, part)
        sums[first + done // 32] = s0


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def int8_rows(xq, scale, total, codes2, scales2, biases2, bits, o_lo, o_hi, out, r, at):  # noqa: ANN001, ANN202
    """`out[r, at + o] = x . w[o]` for outputs `o_lo <= o < o_hi` of one segment (no bias), `x` given as
    quantize_row's codes, scales and totals."""
    groups = scales2.shape[1]
    columns = xq.shape[0]
    half = columns // 2
    sums = np.empty(groups, np.int32)
    for o in range(o_lo, o_hi):
        prefetch_rows(codes2, scales2, biases2, o)
        if bits == 8:
            _row_blocks(codes2, o, xq, 0, BYTE, columns, sums, 0)
        else:
            _row_blocks(codes2, o, xq, 0, LOW, half, sums, 0)
            _row_blocks(codes2, o, xq, half, HIGH, half, sums, half // 32)
        acc = np.float32(0.0)
        for g in range(groups):
            weight_scale, offset = half_to_float(scales2[o, g]), half_to_float(biases2[o, g])
            acc += weight_scale * scale[g] * np.float32(sums[g]) + offset * total[g]
        out[r, at + o] = acc


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def _window_pieces(codes2, o, xq, bits, per16, pieces):  # noqa: ANN001, ANN202
    """The dots of row `o`'s 4-, 5- or 6-bit codes with `xq` into `pieces`, per 32 columns (per 16 where
    `per16`), a 64-column window at a time."""
    columns = xq.shape[0]
    half = columns // 2
    width = bits - 4
    span = columns // (8 // width) if width else half  # columns per bit plane
    mask = (1 << width) - 1
    row_at = np.int64(codes2.ctypes.data) + np.int64(o) * codes2.shape[1]
    x_at = np.int64(xq.ctypes.data)
    plane, plane_end = 0, span  # the plane column c is in (kept by hand: a division costs 30 cycles)
    for c in range(0, columns, 64):
        nibbles = row_at + (c - half if c >= half else c)
        shift = 4 if c >= half else 0
        if c >= plane_end:
            plane, plane_end = plane + 1, plane_end + span
        split = min(plane_end - c, 64)  # the window's columns in this plane; the rest are in the next one
        high_a = row_at + half + c - plane * span if width else nibbles
        if per16:
            s0, s1, s2, s3 = _window16(
                nibbles, shift, high_a, width * plane, high_a - span, width * (plane + 1), split, mask, x_at + c
            )
            pieces[c >> 4], pieces[(c >> 4) + 1], pieces[(c >> 4) + 2], pieces[(c >> 4) + 3] = s0, s1, s2, s3
        else:
            s0, s1 = _window32(
                nibbles, shift, high_a, width * plane, high_a - span, width * (plane + 1), split, mask, x_at + c
            )
            pieces[c >> 5], pieces[(c >> 5) + 1] = s0, s1


@numba.njit(cache=True, nogil=True)
def plane_rows_apply(bits: int, columns: int, group_size: int) -> bool:
    """Whether int8_plane_rows reads codes of `bits` over `columns` in groups of `group_size`: 64-column
    windows that each lie in one half-row and reach into at most two bit planes."""
    if bits < 4 or bits > 6 or columns % 128 or (group_size != 16 and group_size % 32):
        return False
    return bits == 4 or columns // (8 // (bits - 4)) >= 64


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def int8_plane_rows(xq, scale, total, total16, codes2, scales2, biases2, bits, o_lo, o_hi, out, r, at):  # noqa: ANN001, ANN202
    """int8_rows for 4-, 5- and 6-bit codes in groups of 16 or multiples of 32 (plane_rows_apply): each 32
    (or 16) columns' integer dot scaled by its input block's scale, summed into its group, then the group's
    scale and offset applied."""
    columns = xq.shape[0]
    groups = scales2.shape[1]
    blocks = columns // 32
    per_group = blocks // groups  # input blocks a group spans (0: two groups of 16 share one)
    pieces = np.empty(columns // 16, np.int32)
    dots = np.empty(blocks, np.float32)
    scale16 = np.empty(2 * blocks, np.float32)  # each 16 columns' input scale
    for p in range(2 * blocks):
        scale16[p] = scale[p >> 1]
    for o in range(o_lo, o_hi):
        prefetch_rows(codes2, scales2, biases2, o)
        _window_pieces(codes2, o, xq, bits, per_group == 0, pieces)
        acc = np.float32(0.0)
        # The common group sizes in loops LLVM vectorizes (contiguous, no inner loop): 16 and 32.
        if per_group == 0:
            for g in range(groups):
                weight_scale, offset = half_to_float(scales2[o, g]), half_to_float(biases2[o, g])
                acc += weight_scale * scale16[g] * np.float32(pieces[g]) + offset * total16[g]
        elif per_group == 1:
            for g in range(groups):
                weight_scale, offset = half_to_float(scales2[o, g]), half_to_float(biases2[o, g])
                acc += weight_scale * scale[g] * np.float32(pieces[g]) + offset * total[g]
        else:
            for b in range(blocks):
                dots[b] = scale[b] * np.float32(pieces[b])
            for g in range(groups):
                dot, offset = np.float32(0.0), np.float32(0.0)
                for b in range(g * per_group, (g + 1) * per_group):
                    dot += dots[b]
                    offset += total[b]
                acc += half_to_float(scales2[o, g]) * dot + half_to_float(biases2[o, g]) * offset
        out[r, at + o] = acc
