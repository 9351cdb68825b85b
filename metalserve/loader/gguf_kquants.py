"""K-quant decoding in NumPy: Q4_K/Q5_K codes and scales for gguf_affine.py, and a faster Q6_K dequantizer.

Q6_K (the K-quant MLX has no layout for that files hold most, e.g. a Q4_K_M's attn_v and ffn_down) is
decoded with the `gguf` package's arithmetic (so the same fp32 values, bit for bit; the tests compare),
but its codes go straight into the fp32 output, scaled in place: no full-size temporaries. Called on
cache-sized row chunks (gguf_dequant.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf.quants import Q4_K

_NIBBLE = np.uint8(0x0F)


def _halves(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The fp16 d and dmin at the head of each Q4_K/Q5_K block, as fp32 columns."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return d, dmin


def k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K sub-block scales d * sc and offsets dmin * m, (n, 8) fp32 each, as gguf computes them."""
    d, dmin = _halves(blocks)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    return d * sc.astype(np.float32), dmin * m.astype(np.float32)


def q5_k_codes(blocks: np.ndarray) -> np.ndarray:
    """Q5_K blocks (n, 176) -> their 5-bit codes (n, 8, 32) uint8: Q4_K's nibbles plus a fifth bit per
    value from qh (bit i: sub-block i)."""
    qh = blocks[:, 16:48][:, None, :]  # (n, 1, 32)
    qs = blocks[:, 48:176].reshape(-1, 4, 32)
    pairs = np.empty((blocks.shape[0], 4, 2, 32), dtype=np.uint8)
    pairs[:, :, 0] = qs & _NIBBLE
    pairs[:, :, 1] = qs >> 4
    codes = pairs.reshape(-1, 8, 32)
    codes |= ((qh >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4
    return codes


def q6_k_codes(blocks: np.ndarray) -> np.ndarray:
    """Q6_K blocks (n, 210) -> their 6-bit codes (n, 8, 32) uint8, in value order: low nibbles in ql, two
    high bits in qh."""
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 1, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    halves = np.empty((n, 2, 2, 64), dtype=np.uint8)
    halves[:, :, 0:1] = ql & _NIBBLE
    halves[:, :, 1:2] = ql >> 4
    codes = halves.reshape(n, 8, 32)
    codes |= ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3).reshape(n, 8, 32) << 4
    return codes


def q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q6_K blocks (n, 210): 6-bit codes, int8 scales per 16 values, fp16 d."""
    n = blocks.shape[0]
    q = out.reshape(n, 8, 32)
    q[...] = q6_k_codes(blocks)
    q -= 32.0
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    scale = (d * blocks[:, 192:208].view(np.int8).astype(np.float32))[:, :, None]
    q = q.reshape(n, 16, 16)
    np.multiply(scale, q, out=q)


# type -> (block bytes, dequantizer writing (n, 256) fp32 into its `out`)
FAST: dict[str, tuple[int, Callable[[np.ndarray, np.ndarray], None]]] = {
    "Q6_K": (210, q6_k),
}
