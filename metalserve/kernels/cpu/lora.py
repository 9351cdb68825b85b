"""The LoRA delta of a packed step's adapter tokens, for the one-call host decoder (kernels/cpu/decoder.py).

The base projection has already run over every token (`out`); here only the rows of tokens under an
adapter are touched, one group of rows per adapter slot: `low = x[rows] @ A[slot]`, then for each part of
a fused projection (q, k, v; gate, up) `out[rows, part] += scale * low[:, part's ranks] @ B[slot, :, part]`.
A step without adapter tokens has no groups and costs one empty loop per projection.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(fastmath=True, cache=True, nogil=True, boundscheck=False)
def lora_add(x, out, proj, layer, step):  # noqa: ANN001, ANN201  (numba infers the types)
    """`x` `[T, in]` float32, `out` `[T, out]` (updated in place); `proj`: a LoraProjection
    (decoder_weights.py), `step`: a HostLoraStep (lora/layers.py)."""
    rank = proj.b.shape[2]
    parts = proj.bounds.shape[0] - 1
    width = proj.a.shape[3]
    for g in range(step.group_slot.shape[0]):
        slot = step.group_slot[g]
        a = proj.a[layer, slot]  # [in, parts * rank]
        b = proj.b[layer, slot]  # [rank, out]
        low = np.zeros(width, np.float32)
        for i in range(step.group_start[g], step.group_start[g + 1]):
            row = step.rows[i]
            low[:] = 0.0
            for k in range(x.shape[1]):
                xk = x[row, k]
                for j in range(width):
                    low[j] += xk * a[k, j]
            scale = step.scales[i]
            for p in range(parts):
                for j in range(rank):
                    lj = low[p * rank + j] * scale
                    for c in range(proj.bounds[p], proj.bounds[p + 1]):
                        out[row, c] += lj * b[j, c]
