"""Quantized KV pages in NumPy: the reference of the formats (executor/attention/kv_quant.py has them in
MLX ops, the numba kernel reads them in attention.py) and the CPU backend's write path.

int8: `x ~ q * scale`, q in [-127, 127], one float16 scale per vector of head_dim channels.
q4: `x ~ q * scale + bias`, q in [0, 15], a float16 scale and bias per group of channels; two channels
per byte, the even one in the low nibble. Scales are rounded to float16 before the codes are computed.
"""

from __future__ import annotations

import numpy as np


def quantize(x: np.ndarray, storage: str, group_size: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`x` `[..., D]` -> (codes, scales, biases): int8 `[..., D]` and float16 `[..., 1]`; or uint8
    `[..., D/2]` and float16 `[..., D/group_size]` scales and biases."""
    x = np.asarray(x, np.float32)
    if storage == "int8":
        scale = (np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float16)
        s = scale.astype(np.float32)
        q = np.clip(np.rint(x / np.where(s > 0, s, np.float32(1))), -127, 127).astype(np.int8)
        return q, scale, None
    if storage != "q4":
        raise ValueError(f"no quantized storage {storage!r}")
    d = x.shape[-1]
    xg = x.reshape(*x.shape[:-1], d // group_size, group_size)
    low, high = xg.min(axis=-1, keepdims=True), xg.max(axis=-1, keepdims=True)
    scale = ((high - low) / np.float32(15)).astype(np.float16)
    bias = low.astype(np.float16)
    s = scale.astype(np.float32)
    q = np.clip(np.rint((xg - bias.astype(np.float32)) / np.where(s > 0, s, np.float32(1))), 0, 15).astype(np.uint8)
    q = q.reshape(*x.shape[:-1], d // 2, 2)
    return (q[..., 0] | (q[..., 1] << 4)).astype(np.uint8), scale[..., 0], bias[..., 0]


def dequantize(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray | None, storage: str) -> np.ndarray:
    """The inverse of `quantize`, in float32: `[..., D]`."""
    if storage == "int8":
        return codes.astype(np.float32) * scales.astype(np.float32)
    if biases is None:
        raise ValueError("q4 pages need their biases")
    d = 2 * codes.shape[-1]
    groups = scales.shape[-1]
    q = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], groups, d // groups)
    x = q.astype(np.float32) * scales.astype(np.float32)[..., None] + biases.astype(np.float32)[..., None]
    return x.reshape(*codes.shape[:-1], d)
