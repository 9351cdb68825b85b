"""int8 / q4 KV pages inside the one-call host decoder (decoder.py): write, rotate, attend.

The pages' formats are kv_quant.py's (int8: one float16 scale per vector; q4: a float16 scale and bias
per group, two channels a byte, the even one low), stored Hadamard-rotated (executor/attention/rotation.py).
K and V are separate `PagePlane`s, each naming its own storage, so K and V may differ in format (K int8
beside V q4 is one `QuantPages`).

A decode row reads int8 codes directly: the float kernel's four-keys-at-a-time loops with the codes
converted in the loop and each key's scale applied to its sum (a quarter of a float page's bytes). q4
codes are decoded `CHUNK` keys at a time into a float32 buffer that stays in L1, then the float loops
run over it (a direct nibble dot, tried first, ran 2-3x slower than this: per-group scales inside short
loops). A tile of several rows of one request (prefill) decodes its span once, as quantized_attention.py
does, and runs the float loops for each row.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from metalserve.kernels.cpu.attention import _scores, _softmax_rows, _weighted_values
from metalserve.kernels.cpu.quantized_attention import TILE_ROWS, _dequantize_slots, _half, _page_slots
from metalserve.kernels.cpu.work_split import short_long

INT8, Q4 = 1, 2  # PagePlane.storage
CHUNK = 64  # keys a decode row decodes at a time: 16 KB of float32 at head dim 64, within L1


@numba.njit(cache=True, nogil=True)  # no fastmath: the rounding must be IEEE's, as NumPy's
def _to_half(x):  # noqa: ANN001, ANN202  (numba infers the types)
    """(x rounded to float16, as float32; its uint16 bits), round to nearest even like `astype(float16)`."""
    a = abs(np.float64(x))
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0  # -0.0 too, as NumPy keeps its sign bit
    if a != a:
        return np.float32(np.nan), np.uint16(0x7E00)
    if a < 2.0**-14:  # subnormal: steps of 2^-24
        m = np.rint(a * 2.0**24)
        bits = np.int64(m)  # m == 1024 carries into the smallest normal, whose bits are the same number
    else:
        _, e = math.frexp(a)  # a = f 2^e, 0.5 <= f < 1: ten mantissa bits below 2^(e-1)
        step = 2.0 ** (e - 11)
        r = np.rint(a / step) * step
        if r >= 65520.0:
            return np.float32(-np.inf if sign else np.inf), np.uint16(sign | 0x7C00)
        f, e = math.frexp(r)
        bits = np.int64(e + 14) << 10 | np.int64(np.rint((2.0 * f - 1.0) * 1024.0))
    value = _half(np.uint16(bits))
    return (-value if sign else value), np.uint16(bits | sign)


@numba.njit(cache=True, nogil=True)  # no fastmath: x / s must divide, as NumPy's quantize does
def store_vector(codes, scales, biases, storage, slot, x):  # noqa: ANN001, ANN202
    """Quantize `x` `[D]` float32 into slot `slot` of one plane and head (kv_quant.quantize's codes)."""
    dim = x.shape[0]
    if storage == INT8:
        top = np.float32(0.0)
        for c in range(dim):
            top = max(top, abs(x[c]))
        s, bits = _to_half(top / np.float32(127.0))
        scales[slot, 0] = bits
        div = s if s > 0 else np.float32(1.0)
        signed = codes[slot].view(np.int8)
        for c in range(dim):
            signed[c] = np.int8(min(max(np.rint(x[c] / div), np.float32(-127.0)), np.float32(127.0)))
        return
    groups = scales.shape[1]
    width = dim // groups
    for g in range(groups):
        low = high = x[g * width]
        for c in range(g * width + 1, (g + 1) * width):
            low, high = min(low, x[c]), max(high, x[c])
        s, scale_bits = _to_half((high - low) / np.float32(15.0))
        b, bias_bits = _to_half(low)
        scales[slot, g], biases[slot, g] = scale_bits, bias_bits
        div = s if s > 0 else np.float32(1.0)
        for c in range(g * width, (g + 1) * width, 2):
            lo = min(max(np.rint((x[c] - b) / div), np.float32(0.0)), np.float32(15.0))
            hi = min(max(np.rint((x[c + 1] - b) / div), np.float32(0.0)), np.float32(15.0))
            codes[slot, c // 2] = np.uint8(lo) | (np.uint8(hi) << np.uint8(4))


@numba.njit(fastmath=True, cache=True, nogil=True)
def hadamard_rows(x):  # noqa: ANN001, ANN202
    """x[r] <- x[r] @ hadamard(D) for each row of `[R, D]` in place: rotation.hadamard's blocks (the largest
    power of two dividing D) by the fast Walsh-Hadamard transform."""
    rows, dim = x.shape
    block = dim & -dim
    norm = np.float32(1.0 / math.sqrt(block))
    for r in range(rows):
        for start in range(0, dim, block):
            h = 1
            while h < block:
                for i in range(start, start + block, 2 * h):
                    for j in range(i, i + h):
                        a, b = x[r, j], x[r, j + h]
                        x[r, j], x[r, j + h] = a + b, a - b
                h *= 2
        for c in range(dim):
            x[r, c] *= norm


@numba.njit(fastmath=True, cache=True, nogil=True)
def _int8_scores(q, codes, scales, slots, head0, out):  # noqa: ANN001, ANN202
    """out[g, j] = q[head0 + g] . (the int8 key in slots[j]): attention._scores reading the codes."""
    group, n, dim = out.shape[0], slots.shape[0], codes.shape[1]
    j = 0
    for g in range(group):  # the keys' scales once, applied after the sums below
        for jj in range(n):
            out[g, jj] = _half(scales[slots[jj], 0]) if g == 0 else out[0, jj]
    while j + 4 <= n:
        s0, s1, s2, s3 = slots[j], slots[j + 1], slots[j + 2], slots[j + 3]
        for g in range(group):
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for c in range(dim):
                qv = q[head0 + g, c]
                a0 += qv * np.float32(codes[s0, c])
                a1 += qv * np.float32(codes[s1, c])
                a2 += qv * np.float32(codes[s2, c])
                a3 += qv * np.float32(codes[s3, c])
            out[g, j] *= a0
            out[g, j + 1] *= a1
            out[g, j + 2] *= a2
            out[g, j + 3] *= a3
        j += 4
    for jj in range(j, n):
        for g in range(group):
            a = np.float32(0.0)
            for c in range(dim):
                a += q[head0 + g, c] * np.float32(codes[slots[jj], c])
            out[g, jj] *= a


@numba.njit(fastmath=True, cache=True, nogil=True)
def _int8_values(p, codes, scales, slots, out):  # noqa: ANN001, ANN202
    """out[g] = sum_j p[g, j] (the int8 value in slots[j]): attention._weighted_values reading the codes."""
    group, n, dim = p.shape[0], slots.shape[0], out.shape[1]
    out[:] = 0.0
    j = 0
    while j + 4 <= n:
        s0, s1, s2, s3 = slots[j], slots[j + 1], slots[j + 2], slots[j + 3]
        c0, c1 = _half(scales[s0, 0]), _half(scales[s1, 0])
        c2, c3 = _half(scales[s2, 0]), _half(scales[s3, 0])
        for g in range(group):
            p0, p1, p2, p3 = p[g, j] * c0, p[g, j + 1] * c1, p[g, j + 2] * c2, p[g, j + 3] * c3
            for c in range(dim):
                out[g, c] += (
                    p0 * np.float32(codes[s0, c])
                    + p1 * np.float32(codes[s1, c])
                    + p2 * np.float32(codes[s2, c])
                    + p3 * np.float32(codes[s3, c])
                )
        j += 4
    for jj in range(j, n):
        scale = _half(scales[slots[jj], 0])
        for g in range(group):
            for c in range(dim):
                out[g, c] += p[g, jj] * scale * np.float32(codes[slots[jj], c])


@numba.njit(fastmath=True, cache=True, nogil=True)
def _decode_row(q, kc, ks, kb, k_storage, vc, vs, vb, v_storage, slots, head0, scale, softcap, out):  # noqa: ANN001, ANN202
    """One decode row's heads head0 .. head0 + group - 1 over one KV head's pages, `CHUNK` keys at a time:
    each chunk's codes decoded into a float32 buffer that stays in L1, then the float kernel's loops."""
    group, n, dim = out.shape[0], slots.shape[0], out.shape[1]
    scores = np.empty((group, n), np.float32)
    buffer = np.empty((CHUNK, dim), np.float32)
    local = np.arange(CHUNK)
    if k_storage == INT8:
        _int8_scores(q, kc.view(np.int8), ks, slots, head0, scores)
    else:
        for start in range(0, n, CHUNK):
            count = min(CHUNK, n - start)
            _dequantize_plane(kc, ks, kb, k_storage, slots[start : start + count], buffer)
            _scores(q, buffer, local[:count], head0, scores[:, start : start + count])
    pow2, tops = np.empty(n, np.int32), np.empty(group, np.float32)
    _softmax_rows(scores, n, scale, softcap, np.zeros(head0 + group, np.float32), False, head0, pow2, tops)
    if v_storage == INT8:
        _int8_values(scores, vc.view(np.int8), vs, slots, out)
        return
    part = np.empty((group, dim), np.float32)
    out[:] = 0.0
    for start in range(0, n, CHUNK):
        count = min(CHUNK, n - start)
        _dequantize_plane(vc, vs, vb, v_storage, slots[start : start + count], buffer)
        _weighted_values(scores[:, start : start + count], buffer, local[:count], part)
        out += part


@numba.njit(fastmath=True, cache=True, nogil=True)
def _dequantize_plane(codes, scales, biases, storage, slots, out):  # noqa: ANN001, ANN202
    """out[j] = the float32 vector in slots[j] of one plane's head (its `[slots, ...]` arrays)."""
    if storage == INT8:
        _dequantize_slots(codes.view(np.int8), scales, biases, False, slots, out)
    else:
        _dequantize_slots(codes, scales, biases, True, slots, out)


@numba.njit(fastmath=True, cache=True, nogil=True)
def row_tiles_of(row_req):  # noqa: ANN001, ANN202
    """Tile starts (the end appended) over rows in request order: up to TILE_ROWS rows of one request."""
    starts = np.empty(row_req.shape[0] + 1, np.int64)
    count, run = 0, 0
    for r in range(row_req.shape[0]):
        if r == 0 or row_req[r] != row_req[r - 1] or run == TILE_ROWS:
            starts[count] = r
            count, run = count + 1, 0
        run += 1
    starts[count] = row_req.shape[0]
    return starts[: count + 1]


@numba.njit(fastmath=True, cache=True, nogil=True)
def attend_pages(q, pages, block_tables, row_req, row_pos, block_size, scale, window, softcap, out):  # noqa: ANN001, ANN202
    """out[row] = attention of q[row] (rotated) over its request's quantized pages (see the module docstring);
    rows in request order, each request's positions consecutive (CpuStepPlan)."""
    k, v = pages.k, pages.v  # numba's parallel region takes arrays, not the NamedTuples
    args = (block_tables, row_req, row_pos, block_size, scale, window, softcap, out)
    _attend_planes(q, k.codes, k.scales, k.biases, k.storage, v.codes, v.scales, v.biases, v.storage, *args)


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _attend_planes(  # numba infers the types
    q,
    kc,
    ks,
    kb,
    k_storage,
    vc,
    vs,
    vb,
    v_storage,
    block_tables,
    row_req,
    row_pos,
    block_size,
    scale,
    window,
    softcap,
    out,
):
    num_q_heads, num_kv_heads, dim = q.shape[1], kc.shape[0], q.shape[2]
    group = num_q_heads // num_kv_heads
    tile_starts = row_tiles_of(row_req)
    num_tiles = tile_starts.shape[0] - 1
    items = num_tiles * num_kv_heads
    no_sinks = np.zeros(num_q_heads, np.float32)
    for k in numba.prange(items):
        idx = short_long(k, items)  # rows sorted short to long
        tile, h = idx // num_kv_heads, idx % num_kv_heads
        begin, end = tile_starts[tile], tile_starts[tile + 1]
        r = row_req[begin]
        lo = max(0, row_pos[begin] + 1 - window) if window > 0 else 0
        span = row_pos[end - 1] + 1 - lo
        slots = _page_slots(block_tables[r], lo, span, block_size)
        tops = np.empty(group, np.float32)
        pow2 = np.empty(span, np.int32)
        if end - begin == 1:
            heads = out[begin, h * group : (h + 1) * group]
            _decode_row(
                q[begin],
                kc[h],
                ks[h],
                kb[h],
                k_storage,
                vc[h],
                vs[h],
                vb[h],
                v_storage,
                slots,
                h * group,
                scale,
                softcap,
                heads,
            )
        else:
            keys, values = np.empty((span, dim), np.float32), np.empty((span, dim), np.float32)
            _dequantize_plane(kc[h], ks[h], kb[h], k_storage, slots, keys)
            _dequantize_plane(vc[h], vs[h], vb[h], v_storage, slots, values)
            for row in range(begin, end):
                first = max(0, row_pos[row] + 1 - window) if window > 0 else 0
                n = row_pos[row] + 1 - first
                local = np.arange(n) + (first - lo)
                scores = np.empty((group, n), np.float32)
                _scores(q[row], keys, local, h * group, scores)
                _softmax_rows(scores, n, scale, softcap, no_sinks, False, h * group, pow2, tops)
                _weighted_values(scores, values, local, out[row, h * group : (h + 1) * group])
