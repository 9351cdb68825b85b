"""Extract the stored integer codes of an affine-quantized MLX layer (see metalserve/kernels/cpu/affine_codes.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.kernels.cpu.affine_codes import AffineCodes

__all__ = ["AffineCodes", "affine_codes", "unpack_codes"]


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packed affine codes (uint32 `[rows, cols * bits / 32]`) as uint8 `[rows, cols]`.

    MLX packs a little-endian bit stream (eight values in `bits` bytes). NumPy unpacks it several times
    faster than MLX's CPU dequantize does (bench: bench/gguf_dequant.py's note in README)."""
    data = np.ascontiguousarray(packed).view(np.uint8)
    rows = data.shape[0]
    if bits == 8:
        return data.reshape(rows, -1)
    if bits == 4:
        out = np.empty((rows, data.shape[1], 2), dtype=np.uint8)
        out[..., 0] = data & np.uint8(0x0F)
        out[..., 1] = data >> 4
        return out.reshape(rows, -1)
    groups = data.reshape(-1, bits).astype(np.uint64)  # `bits` bytes hold eight values
    stream = np.zeros(groups.shape[0], dtype=np.uint64)
    for k in range(bits):
        stream |= groups[:, k] << np.uint64(8 * k)
    mask = np.uint64((1 << bits) - 1)
    codes = np.stack([(stream >> np.uint64(bits * i)) & mask for i in range(8)], axis=1)
    return codes.astype(np.uint8).reshape(rows, -1)


def affine_codes(module: nn.QuantizedLinear | nn.QuantizedEmbedding) -> AffineCodes | None:
    """The codes of an affine-quantized layer of up to 8 bits; None for other modes."""
    biases = module.get("biases")
    if getattr(module, "mode", "affine") != "affine" or module.bits > 8 or biases is None:
        return None
    codes = unpack_codes(np.array(module.weight), module.bits)
    return AffineCodes(codes, np.array(module.scales.astype(mx.float32)), np.array(biases.astype(mx.float32)))
