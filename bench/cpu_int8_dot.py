"""What int8 activations and VNNI would buy the CPU decode path: a prototype matvec against the kernel in use.

    PYTHONPATH=$PWD NUMBA_NUM_THREADS=1 .venv/bin/python bench/cpu_int8_dot.py [--repeat 50] [--rounds 5]

llama.cpp's lead at one stream (docs/cpu-path.md) is its dot product: the input row quantized to int8 per
block of 32, and each block of weight codes dotted with it in integers, 64 byte pairs per AVX-512 VNNI
instruction (`vpdpbusd`), where the fast path dequantizes every weight to fp32 first. numba's own integer
arithmetic widens to int64 and never reaches that instruction, so this prototype emits it through
`numba.extending.intrinsic` (LLVM IR, `llvm.x86.avx512.vpdpbusd.512` / `.256`), one 64- or 32-byte chunk at a
time inside an ordinary numba loop. A block's integer sum is then scaled by the weight's and the input's
scales; the offsets take the input's block sums.

Printed per shape (the decode projections of the default model and the coder 0.5B, 4- and 8-bit codes as
the loader packs them): the fastest call of the kernel in use (packed_linear.segments_linear_kernel, one
row) and of the prototype, their ratio, and each one's largest error against float64 relative to the
largest output. Needs a CPU with AVX-512 VNNI; elsewhere it says so and exits. Not wired into the server:
the error (int8 activations, ~5e-3 here, as llama.cpp's) is larger than the 1e-3 logprob agreement the
codes path keeps with the dequantized model today.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numba
import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.extending import intrinsic

from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.kernels.cpu.packed_linear import segments_linear_kernel, segments_of

LOW, HIGH, BYTE = 0, 1, 2  # which part of each code byte a chunk's dot reads


def has_vnni() -> bool:
    features = binding.get_host_cpu_features()
    return bool(features.get("avx512vnni")) and bool(features.get("avx512vl"))


def _chunk_dot(width: int) -> Any:
    """An intrinsic: (codes address, int8 input address, part) -> the int32 dots of each 32-byte block of a
    `width`-byte chunk (a tuple of width // 32)."""
    lanes = width // 4
    blocks = width // 32

    @intrinsic
    def chunk_dot(typingctx: Any, codes: Any, xq: Any, part: Any) -> Any:
        sig = types.UniTuple(types.int32, blocks)(codes, xq, part)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            i8, i32 = ir.IntType(8), ir.IntType(32)
            bytes_t, lanes_t = ir.VectorType(i8, width), ir.VectorType(i32, lanes)
            block_t = ir.VectorType(i32, 8)
            name = f"llvm.x86.avx512.vpdpbusd.{lanes * 32}"
            module = builder.module
            dot = module.globals.get(name) or ir.Function(module, ir.FunctionType(lanes_t, [lanes_t] * 3), name=name)
            reduce_name = "llvm.vector.reduce.add.v8i32"
            reduce_type = ir.FunctionType(i32, [block_t])
            reduce = module.globals.get(reduce_name) or ir.Function(module, reduce_type, reduce_name)
            codes_at = builder.inttoptr(args[0], bytes_t.as_pointer())
            x_at = builder.inttoptr(args[1], bytes_t.as_pointer())
            raw = builder.load(codes_at, align=1)
            low = builder.and_(raw, ir.Constant(bytes_t, [15] * width))
            high = builder.lshr(raw, ir.Constant(bytes_t, [4] * width))
            part = args[2]
            is_low = builder.icmp_signed("==", part, ir.Constant(part.type, LOW))
            is_high = builder.icmp_signed("==", part, ir.Constant(part.type, HIGH))
            chosen = builder.select(is_low, low, builder.select(is_high, high, raw))
            x = builder.load(x_at, align=1)
            zero = ir.Constant(lanes_t, [0] * lanes)
            sums = builder.call(dot, [zero, builder.bitcast(chosen, lanes_t), builder.bitcast(x, lanes_t)])
            outs = []
            for b in range(blocks):
                pick = ir.Constant(ir.VectorType(i32, 8), list(range(8 * b, 8 * b + 8)))
                outs.append(builder.call(reduce, [builder.shuffle_vector(sums, sums, pick)]))
            return context.make_tuple(builder, signature.return_type, outs)

        return sig, codegen

    return chunk_dot


_dot64 = _chunk_dot(64)
_dot32 = _chunk_dot(32)


@numba.njit(fastmath=True, cache=False, boundscheck=False)
def quantize_blocks(x):  # noqa: ANN001, ANN202
    """Row `x` to int8 per block of 32 (llama.cpp's Q8_0): codes, each block's scale and its code sum."""
    blocks = x.shape[0] // 32
    xq = np.empty(x.shape[0], np.int8)
    scale = np.empty(blocks, np.float32)
    total = np.empty(blocks, np.float32)
    for b in range(blocks):
        amax = np.float32(0.0)
        for k in range(32):
            amax = max(amax, abs(x[32 * b + k]))
        d = amax / np.float32(127.0) if amax > 0 else np.float32(1.0)
        s = 0
        for k in range(32):
            q = np.int32(np.round(x[32 * b + k] / d))
            xq[32 * b + k] = np.int8(q)
            s += q
        scale[b], total[b] = d, np.float32(s) * d
    return xq, scale, total


@numba.njit(fastmath=True, cache=False, boundscheck=False)
def _row_blocks(codes2, o, start, xq, x_off, part, count, sums, first):  # noqa: ANN001, ANN202
    """The block dots of bytes [start, start + count) of row `o` of `codes2` with `xq[x_off:]` into
    sums[first:]. The arrays, not their addresses, are passed: numba frees an array after its last use,
    so an address kept past it would read freed memory."""
    codes_at = np.int64(codes2.ctypes.data) + np.int64(o) * codes2.shape[1] + start
    x_at = np.int64(xq.ctypes.data) + x_off
    done = 0
    while done + 64 <= count:
        s0, s1 = _dot64(codes_at + done, x_at + done, part)
        sums[first + done // 32], sums[first + done // 32 + 1] = s0, s1
        done += 64
    if done < count:
        (s0,) = _dot32(codes_at + done, x_at + done, part)
        sums[first + done // 32] = s0


@numba.njit(parallel=True, fastmath=True, cache=False, boundscheck=False)
def int8_matvec(x, codes2, scales2, biases2, bits, out, chunks):  # noqa: ANN001, ANN202
    """out[o] = x . w[o] for codes of 4 bits (half-rows of whole groups) or 8 bits, groups of 32;
    `codes2` C-contiguous."""
    outputs, columns = codes2.shape[0], x.shape[0]
    groups = columns // 32
    xq, xscale, xtotal = quantize_blocks(x)
    per = (outputs + chunks - 1) // chunks
    half = columns // 2
    for c in numba.prange(chunks):
        sums = np.empty(groups, np.int32)
        for o in range(c * per, min(outputs, (c + 1) * per)):
            if bits == 8:
                _row_blocks(codes2, o, 0, xq, 0, BYTE, columns, sums, 0)
            else:
                _row_blocks(codes2, o, 0, xq, 0, LOW, half, sums, 0)
                _row_blocks(codes2, o, 0, xq, half, HIGH, half, sums, half // 32)
            acc = np.float32(0.0)
            for g in range(groups):
                acc += scales2[o, g] * xscale[g] * np.float32(sums[g]) + biases2[o, g] * xtotal[g]
            out[o] = acc


def _case(rows: int, columns: int, bits: int, args: argparse.Namespace) -> str:
    rng = np.random.default_rng(rows + columns + bits)
    x = rng.standard_normal(columns).astype(np.float32)
    scales = rng.uniform(0.01, 0.1, (rows, columns // 32)).astype(np.float32)
    biases = rng.uniform(-1, 1, (rows, columns // 32)).astype(np.float32)
    packed = PackedCodes.pack(rng.integers(0, 1 << bits, (rows, columns)), scales, biases, bits)
    segments = segments_of([[packed]])
    want = packed.dense().astype(np.float64) @ x.astype(np.float64)
    chunks = numba.get_num_threads() * 8
    codes2 = packed.codes
    scales2, biases2 = np.ascontiguousarray(packed.scales), np.ascontiguousarray(packed.biases)
    tile, proto = np.zeros((1, rows), np.float32), np.zeros(rows, np.float32)
    arms = {
        "tile": lambda: segments_linear_kernel(x[None], segments, 0, chunks, tile),
        "int8": lambda: int8_matvec(x, codes2, scales2, biases2, bits, proto, chunks),
    }
    best = dict.fromkeys(arms, float("inf"))
    for call in arms.values():  # compiled before the clock starts
        call()
    for _ in range(args.rounds):  # the fastest call of each: on a shared machine the rest is others' load
        for name, call in arms.items():
            for _ in range(args.repeat):
                start = time.perf_counter()
                call()
                best[name] = min(best[name], time.perf_counter() - start)
    scale = np.abs(want).max()
    err_tile, err_int8 = np.abs(tile[0] - want).max() / scale, np.abs(proto - want).max() / scale
    return (
        f"{rows:6} x {columns:5} {bits} bits: tile {best['tile'] * 1e6:7.0f} us (error {err_tile:.1e}), "
        f"int8 {best['int8'] * 1e6:7.0f} us (error {err_int8:.1e}): {best['int8'] / best['tile']:.2f}x"
    )


SHAPES = [  # (rows, columns, bits): decode projections of the default model and the coder 0.5B
    (1536, 576, 4),
    (576, 1536, 4),
    (49152 // 4, 576, 8),
    (9728, 896, 4),
    (896, 4864, 4),
    (1152, 896, 8),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not has_vnni():
        print("this CPU has no AVX-512 VNNI: the prototype needs it")
        return
    print(f"threads {numba.get_num_threads()}; fastest call of each arm, interleaved for {args.rounds} rounds")
    for rows, columns, bits in SHAPES:
        print(_case(rows, columns, bits, args), flush=True)


if __name__ == "__main__":
    main()
