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
groups of 32, and 8 bits with groups of 32; every other layout keeps the float kernel.
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


def _block_sums(builder: ir.IRBuilder, chosen: ir.Value, x: ir.Value, width: int) -> list[ir.Value]:
    """The int32 dot of each 32-byte block of the `width` chosen code bytes (unsigned) with `x` (signed)."""
    i32 = ir.IntType(32)
    module = builder.module
    if has_vnni():
        lanes_t = ir.VectorType(i32, width // 4)
        name = f"llvm.x86.avx512.vpdpbusd.{width * 8}"
        dot = module.globals.get(name) or ir.Function(module, ir.FunctionType(lanes_t, [lanes_t] * 3), name=name)
        zero = ir.Constant(lanes_t, [0] * (width // 4))
        sums = builder.call(dot, [zero, builder.bitcast(chosen, lanes_t), builder.bitcast(x, lanes_t)])
        per_block = 8
    else:
        wide_t = ir.VectorType(i32, width)
        sums = builder.mul(builder.zext(chosen, wide_t), builder.sext(x, wide_t))
        per_block = 32
    block_t = ir.VectorType(i32, per_block)
    name = f"llvm.vector.reduce.add.v{per_block}i32"
    reduce = module.globals.get(name) or ir.Function(module, ir.FunctionType(i32, [block_t]), name=name)
    out = []
    for b in range(width // 32):
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


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def quantize_row(x, r, xq, scale, total):  # noqa: ANN001, ANN202  (numba infers the types)
    """Row `r` of `x` to int8 per block of 32 (llama.cpp's Q8_0): the codes, each block's scale, and the
    sum of its dequantized codes (for the offset term)."""
    for b in range(x.shape[1] // 32):
        amax = np.float32(0.0)
        for k in range(32):
            amax = max(amax, abs(x[r, 32 * b + k]))
        d = amax / np.float32(127.0) if amax > 0 else np.float32(1.0)
        codes = np.int64(0)
        for k in range(32):
            q = np.int32(np.round(x[r, 32 * b + k] / d))
            xq[32 * b + k] = np.int8(q)
            codes += q
        scale[b], total[b] = d, np.float32(codes) * d


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
        if bits == 8:
            _row_blocks(codes2, o, xq, 0, BYTE, columns, sums, 0)
        else:
            _row_blocks(codes2, o, xq, 0, LOW, half, sums, 0)
            _row_blocks(codes2, o, xq, half, HIGH, half, sums, half // 32)
        acc = np.float32(0.0)
        for g in range(groups):
            acc += scales2[o, g] * scale[g] * np.float32(sums[g]) + biases2[o, g] * total[g]
        out[r, at + o] = acc
