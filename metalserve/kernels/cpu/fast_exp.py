"""exp(v) for v <= 0 as a polynomial and a power of two, in a form LLVM vectorises inside a caller's loop.

libm's exp is one call per value, which keeps a softmax loop scalar. Here v = k ln 2 + r (Cody-Waite), e^r
a degree-7 polynomial and 2^k the int32 bits `(k + 127) << 23`: the caller stores the two in its own
arrays and multiplies them in a second loop (viewing the bits as float32), so both loops stay vector loops.
Inlined into the caller at numba's level (`inline="always"`), so the loop body is as written out.

`lane_max`, the softmax's other pass: a running `max(top, x)` stays scalar in numba's LLVM (about 1 ns an
element here, more than the exp); sixteen running maxima, one per lane, vectorise (0.25 ns).
"""

from __future__ import annotations

import numba
import numpy as np

# exp(v) below e^-64 is taken as 0. Clamped to e^-87 instead (about the smallest normal float32), a softmax
# over a long context gave its far-below-the-maximum keys weights of ~1e-38, and their products with the
# values were denormal: x86 takes a microcode assist on each (nothing sets flush-to-zero), and a 512-token
# prefill chunk of the coder 0.5B at 4k of context took 5.7 s instead of 2.9 on bench/cpu_prefill.py's random
# hidden states (the two trees alternated). A softmax's largest weight is 1, so weights under 1.6e-28 change
# no float32 sum.
FLUSH_BELOW = np.float32(-64.0)


@numba.njit(fastmath=True, cache=True, nogil=True, inline="always")
def exp_parts(v):  # noqa: ANN001, ANN202  (numba infers the types)
    """(e^r, the float32 bits of 2^k) with exp(v) = e^r * 2^k for v <= 0; below FLUSH_BELOW the bits are
    0 (exp 0)."""
    flushed = v < FLUSH_BELOW
    v = max(v, FLUSH_BELOW)
    k = np.floor(v * np.float32(1.4426950408889634) + np.float32(0.5))
    r = (v - k * np.float32(0.693359375)) + k * np.float32(2.12194440e-4)  # Cody-Waite: r = v - k ln 2
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    bits = (np.int32(k) + np.int32(127)) << np.int32(23)
    return p * r + np.float32(1.0), np.int32(0) if flushed else bits


LANES = 16


@numba.njit(fastmath=True, cache=True, nogil=True, inline="always")
def lane_max(row, lo, hi, lanes):  # noqa: ANN001, ANN202
    """max(row[lo:hi]) (hi > lo), through `lanes` (float32 scratch of LANES): a running maximum per lane."""
    lanes[:] = row[lo]
    j = lo
    while j + LANES <= hi:
        for k in range(LANES):
            v = row[j + k]
            lanes[k] = v if v > lanes[k] else lanes[k]
        j += LANES
    top = lanes[0]
    for k in range(1, LANES):
        top = lanes[k] if lanes[k] > top else top
    for i in range(j, hi):
        top = row[i] if row[i] > top else top
    return top
