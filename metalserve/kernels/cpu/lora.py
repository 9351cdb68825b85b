"""The LoRA delta of a packed step's adapter tokens, for the one-call host decoder (kernels/cpu/decoder.py).

The base projection has already run over every token (`out`); here only the rows of tokens under an
adapter are touched, one group of rows per adapter slot: `low = x[rows] @ A[slot]`, then for each part of
a fused projection (q, k, v; gate, up) `out[rows, part] += scale * low[:, part's ranks] @ B[slot, part]`.
A step without adapter tokens has no groups and costs one empty loop per projection.

Each group reads its slot's A once for all its rows (A's rows outermost), and B is stored transposed,
`[out, R]`, so each output column's R weights are contiguous: 1.6x faster than a row at a time through
`[R, out]` (8 rows over 4 slots, the default model's shapes).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def lora_add(x, out, proj, layer, step):  # noqa: ANN001, ANN201  (numba infers the types)
    """`x` `[T, in]` float32, `out` `[T, out]` (updated in place); `proj`: a LoraProjection
    (decoder_weights.py), `step`: a HostLoraStep."""
    rank = proj.bt.shape[3]
    width = proj.a.shape[3]
    for g in range(step.group_slot.shape[0]):
        slot = step.group_slot[g]
        lo, n = step.group_start[g], step.group_start[g + 1] - step.group_start[g]
        a = proj.a[layer, slot]  # [in, parts * R]
        bt = proj.bt[layer, slot]  # [out, R]
        low = np.zeros((n, width), np.float32)
        for k in range(a.shape[0]):
            for i in range(n):
                xk = x[step.rows[lo + i], k]
                for j in range(width):
                    low[i, j] += xk * a[k, j]
        for i in range(n):
            row, scale = step.rows[lo + i], step.scales[lo + i]
            for p in range(proj.bounds.shape[0] - 1):
                for c in range(proj.bounds[p], proj.bounds[p + 1]):
                    acc = np.float32(0.0)
                    for j in range(rank):
                        acc += low[i, p * rank + j] * bt[c, j]
                    out[row, c] += scale * acc
