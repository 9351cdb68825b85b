"""`x @ w.T` for rows of `x`, reading `w` in its packed codes (packed_codes.py), compiled with numba.

Decoding on the CPU is bound by reading the weights: fp32 costs four bytes a weight, the packed codes
half a byte (4 bits) to one (8 bits), plus a scale and offset per group. Every four output rows are
unpacked once into a scratch tile in L1 and then dotted with the input rows four at a time (sixteen
accumulators share each load of the tile and of the input), so the same kernel serves a decode step and a
prefill chunk: the unpacking is paid once per four output rows whatever the number of input rows.
(Against one output row at a time, the four-row tile took the default model's projections from 36 to 28 ms
at 8 rows and from 73 to 54 ms at 16, measured on one-byte codes.)

Steps of GEMM_MIN_ROWS rows and more (prefill chunks) take packed_gemm.py instead: fp32 tiles through
MKL's GEMM, where the matmul rather than reading the weights is the cost.

A projection is a list of row blocks ("segments"), each packed its own way: a GGUF's fused q/k/v may
mix 4-bit q and k with a 6-bit v, and its layers may differ. `Segments` holds one list per projection
and layer range, the arrays shared with the codes they came from (no copy).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from numba.typed import List

from metalserve.kernels.cpu import int8_dot, int8_segments
from metalserve.kernels.cpu.arg_types import register_memoized_type
from metalserve.kernels.cpu.gemm import host_gemm
from metalserve.kernels.cpu.int8_dot import half_to_float
from metalserve.kernels.cpu.numba_lock import launch_lock
from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.kernels.cpu.packed_gemm import GEMM_MIN_ROWS, segments_gemm_kernel
from metalserve.kernels.cpu.packed_unpack import unpack_planes, unpack_row


@register_memoized_type
class Segments(NamedTuple):
    """Row blocks of one projection in several layers: segment `s` is `data[s]` (its codes, flat),
    `scales[s]`/`biases[s]` (flat), `rows[s]` outputs at `out_at[s]`, `bits[s]`; the segments of layer
    `l` are `layer_first[l]` to `layer_first[l + 1]`. `bias` `[L, out]`: the projection's own bias."""

    data: List
    scales: List
    biases: List
    rows: np.ndarray
    bits: np.ndarray
    out_at: np.ndarray
    layer_first: np.ndarray
    bias: np.ndarray
    columns: int
    int8: bool  # decode rows dotted in integers where the codes allow (int8_dot.py, --cpu-int8-activations)


def segments_of(layers: list[list[PackedCodes]], bias: np.ndarray | None = None, int8: bool | None = None) -> Segments:
    """The segments of a projection whose layer `l` stacks `layers[l]`'s parts row-wise. `int8`: None
    takes the process's --cpu-int8-activations (int8_dot.enabled())."""
    data, scales, biases = List(), List(), List()
    rows, bits, out_at, layer_first = [], [], [], [0]
    for parts in layers:
        at = 0
        for part in parts:
            for flat, into in zip(part.kernel_arrays(), (data, scales, biases), strict=True):
                into.append(flat)
            rows.append(part.shape[0])
            bits.append(part.bits)
            out_at.append(at)
            at += part.shape[0]
        layer_first.append(len(rows))
    outputs = sum(p.shape[0] for p in layers[0])
    if bias is None:
        bias = np.zeros((len(layers), outputs), np.float32)
    columns = layers[0][0].columns
    rows_a, bits_a, out_at_a, first_a = (np.array(v, np.int64) for v in (rows, bits, out_at, layer_first))
    int8 = int8_dot.enabled() if int8 is None else int8
    bias_a = np.ascontiguousarray(bias, np.float32)
    return Segments(data, scales, biases, rows_a, bits_a, out_at_a, first_a, bias_a, columns, bool(int8))


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def _store(out, r, first, outputs, a0, a1, a2, a3):  # noqa: ANN001, ANN202  (numba infers the types)
    """One input row's four outputs, the ones past the last output row dropped."""
    out[r, first] = a0
    if first + 1 < outputs:
        out[r, first + 1] = a1
    if first + 2 < outputs:
        out[r, first + 2] = a2
    if first + 3 < outputs:
        out[r, first + 3] = a3


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def _four_rows(x, r, w, out, first, outputs):  # noqa: ANN001, ANN202
    """Rows r..r+3 of `x` against the four dequantized output rows in `w`."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
    for k in range(x.shape[1]):
        w0 = w[0, k]
        w1 = w[1, k]
        w2 = w[2, k]
        w3 = w[3, k]
        x0 = x[r, k]
        x1 = x[r + 1, k]
        x2 = x[r + 2, k]
        x3 = x[r + 3, k]
        a00 += w0 * x0
        a01 += w1 * x0
        a02 += w2 * x0
        a03 += w3 * x0
        a10 += w0 * x1
        a11 += w1 * x1
        a12 += w2 * x1
        a13 += w3 * x1
        a20 += w0 * x2
        a21 += w1 * x2
        a22 += w2 * x2
        a23 += w3 * x2
        a30 += w0 * x3
        a31 += w1 * x3
        a32 += w2 * x3
        a33 += w3 * x3
    _store(out, r, first, outputs, a00, a01, a02, a03)
    _store(out, r + 1, first, outputs, a10, a11, a12, a13)
    _store(out, r + 2, first, outputs, a20, a21, a22, a23)
    _store(out, r + 3, first, outputs, a30, a31, a32, a33)


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def _two_rows(x, r, w, out, first, outputs):  # noqa: ANN001, ANN202
    """Rows r and r+1 of `x` against the four dequantized output rows in `w`."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
    for k in range(x.shape[1]):
        w0, w1, w2, w3 = w[0, k], w[1, k], w[2, k], w[3, k]
        x0, x1 = x[r, k], x[r + 1, k]
        a00 += w0 * x0
        a01 += w1 * x0
        a02 += w2 * x0
        a03 += w3 * x0
        a10 += w0 * x1
        a11 += w1 * x1
        a12 += w2 * x1
        a13 += w3 * x1
    _store(out, r, first, outputs, a00, a01, a02, a03)
    _store(out, r + 1, first, outputs, a10, a11, a12, a13)


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def _one_row(x, r, w, out, first, outputs):  # noqa: ANN001, ANN202
    """Row r of `x` against the four dequantized output rows in `w`."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for k in range(x.shape[1]):
        xv = x[r, k]
        a0 += w[0, k] * xv
        a1 += w[1, k] * xv
        a2 += w[2, k] * xv
        a3 += w[3, k] * xv
    _store(out, r, first, outputs, a0, a1, a2, a3)


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True, boundscheck=False)
def segments_linear_kernel(x, seg, layer, chunks, out):  # noqa: ANN001, ANN202
    """`out[:, :] = x @ w.T + bias` for layer `layer` of `seg` (see Segments)."""
    rows = x.shape[0]
    columns = seg.columns
    first, last = seg.layer_first[layer], seg.layer_first[layer + 1]
    # Decode rows in integers (int8_segments.py): the input quantized once here, each eligible segment's rows
    # then dotted against it; the four-row tile below stays for everything else.
    quantized = int8_segments.quantized_input(x, seg, first, last)
    quads = 0
    for s in range(first, last):
        quads += (seg.rows[s] + 3) // 4
    per_chunk = (quads + chunks - 1) // chunks
    for c in numba.prange(chunks):
        w = np.empty((4, columns), np.float32)
        chunk_first, chunk_end = c * per_chunk, min(quads, (c + 1) * per_chunk)
        skipped = 0  # quads of the segments before `s`
        for s in range(first, last):
            outputs = seg.rows[s]
            lo, hi = max(chunk_first, skipped), min(chunk_end, skipped + (outputs + 3) // 4)
            skipped += (outputs + 3) // 4
            if lo >= hi:
                continue
            # Everything per segment, not per quad: a typed list's item costs a call and a reference
            # count, a reshape a reference count (an atomic).
            data, scales, biases = seg.data[s], seg.scales[s], seg.biases[s]
            bits, at = seg.bits[s], seg.out_at[s]
            groups = scales.shape[0] // outputs
            size, lower = columns // groups, groups // 2
            whole = bits == 8 or (bits == 4 and (columns // 2) % (columns // groups) == 0)
            codes2 = data.reshape(outputs, data.shape[0] // outputs)
            scales2, biases2 = scales.reshape(outputs, groups), biases.reshape(outputs, groups)
            first_quad = skipped - (outputs + 3) // 4
            o_lo, o_hi = 4 * (lo - first_quad), min(outputs, 4 * (hi - first_quad))
            if int8_segments.int8_segment(quantized, codes2, scales2, biases2, bits, o_lo, o_hi, out, at):
                continue
            for quad in range(lo - first_quad, hi - first_quad):
                local = 4 * quad
                # The next quad's rows asked for while this one's are unpacked, where unpacking is cheap
                # enough for the reads to lag (4 and 8 bits; 5 and 6 took longer with it).
                if bits == 4 or bits == 8:
                    for j in range(4):
                        int8_dot.prefetch_rows(codes2, scales2, biases2, local + j)
                # The unpacking loops written out here, beside `w`'s allocation, not called: in a callee
                # LLVM left them 20% slower (the default model's Q8_0 head, 49152 rows).
                if bits == 8:
                    for j in range(4):
                        o = min(local + j, outputs - 1)
                        for g in range(groups):
                            base = g * size
                            s0, m0 = half_to_float(scales2[o, g]), half_to_float(biases2[o, g])
                            for k in range(size):
                                w[j, base + k] = s0 * np.float32(codes2[o, base + k]) + m0
                elif whole:  # 4 bits whose half-rows hold whole groups
                    for j in range(4):
                        o = min(local + j, outputs - 1)
                        for g in range(lower):
                            base, top = g * size, (lower + g) * size
                            s0, m0 = half_to_float(scales2[o, g]), half_to_float(biases2[o, g])
                            s1, m1 = half_to_float(scales2[o, lower + g]), half_to_float(biases2[o, lower + g])
                            for k in range(size):
                                byte = np.int32(codes2[o, base + k])
                                w[j, base + k] = s0 * np.float32(byte & 15) + m0
                                w[j, top + k] = s1 * np.float32(byte >> 4) + m1
                else:  # 5 and 6 bits (and 4 bits whose groups straddle the half-row)
                    for j in range(4):
                        unpack_planes(codes2, scales2, biases2, min(local + j, outputs - 1), bits, size, w, j)
                r = 0
                while r + 4 <= rows:
                    _four_rows(x, r, w, out, at + local, at + outputs)
                    r += 4
                if r + 2 <= rows:
                    _two_rows(x, r, w, out, at + local, at + outputs)
                    r += 2
                if r < rows:
                    _one_row(x, r, w, out, at + local, at + outputs)
    bias = seg.bias[layer]
    for t in range(rows):
        for o in range(out.shape[1]):
            out[t, o] += bias[o]


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True, boundscheck=False)
def gather_rows_kernel(data, scales, biases, bits, columns, groups, ids, out):  # noqa: ANN001, ANN202
    """`out[t] = row ids[t]` of one packed segment, in fp32 (an embedding lookup)."""
    for t in numba.prange(ids.shape[0]):
        unpack_row(data, scales, biases, ids[t], bits, columns, groups, out, t)


@numba.njit(fastmath=True, cache=True, boundscheck=False)
def gather_few_rows_kernel(data, scales, biases, bits, columns, groups, ids, out):  # noqa: ANN001, ANN202
    """`gather_rows_kernel` on the calling thread, the GIL held: a decode step's few rows take microseconds,
    less than waking the pool's workers (which may be off their cores) or taking the GIL back."""
    for t in range(ids.shape[0]):
        unpack_row(data, scales, biases, ids[t], bits, columns, groups, out, t)


# Above this many rows a lookup (a prefill chunk's) is worth the parallel region.
FEW_ROWS = 16


def packed_linear(x: np.ndarray, segments: Segments, layer: int = 0) -> np.ndarray:
    """`x` `[T, in]` float32 -> `x @ w.T + bias` `[T, out]` for layer `layer` of `segments`."""
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != segments.columns:
        raise ValueError(f"packed_linear takes [T, {segments.columns}] float32, got {x.shape} {x.dtype}")
    out = np.zeros((x.shape[0], segments.bias.shape[1]), np.float32)
    gemm = host_gemm()
    with launch_lock:
        if x.shape[0] >= GEMM_MIN_ROWS and gemm.usable:  # a prefill chunk: tiles of fp32, then MKL's GEMM
            segments_gemm_kernel(np.ascontiguousarray(x), segments, layer, gemm, out)
            return out
        # Several chunks per thread even out a core that is busy with something else.
        chunks = numba.get_num_threads() * 8
        segments_linear_kernel(np.ascontiguousarray(x), segments, layer, chunks, out)
    return out


def gather_rows(codes: PackedCodes, ids: np.ndarray) -> np.ndarray:
    """The fp32 rows `ids` of `codes` `[len(ids), columns]` (an embedding lookup from the codes)."""
    ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= codes.shape[0]):
        raise ValueError(f"row ids must lie in [0, {codes.shape[0]})")
    out = np.empty((ids.size, codes.columns), np.float32)
    data, scales, biases = codes.kernel_arrays()
    kernel = gather_few_rows_kernel if ids.size <= FEW_ROWS else gather_rows_kernel
    with launch_lock:
        kernel(data, scales, biases, codes.bits, codes.columns, codes.scales.shape[1], ids, out)
    return out
