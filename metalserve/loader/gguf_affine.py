"""GGUF quant blocks repacked, exactly, into MLX's affine layout (`w = scale * q + bias` per group of 32).

Q4_K (4 bits) and Q5_K, Q5_0, Q5_1 (5 bits) have groups of 32 with one scale and one offset each, so
they map onto MLX's layout without changing a value: MLX's dequantization gives gguf's fp32 values bit
for bit (the products of an fp16 and a small integer are exact in fp32; the tests compare). Kept packed
they stay quantized on Metal, and the CPU host path reads their codes. Q2_K, Q3_K and Q6_K use groups
of 16, which MLX does not have.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from metalserve.loader.gguf_kquants import k_scales, q5_k_codes

_NIBBLE = np.uint8(0x0F)
Packed = tuple[np.ndarray, np.ndarray, np.ndarray]  # codes packed in uint32, fp32 scales, fp32 biases


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes (n, k) -> MLX's packing: a little-endian bit stream, eight values in `bits` bytes."""
    groups = codes.reshape(-1, 8).astype(np.uint64)
    stream = np.zeros(groups.shape[0], dtype=np.uint64)
    for i in range(8):
        stream |= groups[:, i] << np.uint64(bits * i)
    packed = stream.view(np.uint8).reshape(-1, 8)[:, :bits]  # little-endian: the low `bits` bytes
    return np.ascontiguousarray(packed).reshape(codes.shape[0], -1).view("<u4")


def q4_k(blocks: np.ndarray) -> Packed:
    """Q4_K (n, 144): sub-block 2g holds the low nibbles of 32-byte group g, 2g+1 the high ones; MLX packs
    two values a byte, the even one low, so each packed byte merges the same nibble of two neighbours."""
    qs = blocks[:, 16:144].reshape(-1, 4, 16, 2)
    even, odd = qs[..., 0], qs[..., 1]
    packed = np.empty((blocks.shape[0], 4, 2, 16), dtype=np.uint8)
    packed[:, :, 0] = (even & _NIBBLE) | (odd << 4)
    packed[:, :, 1] = (even >> 4) | (odd & np.uint8(0xF0))
    scale, offset = k_scales(blocks)
    return packed.reshape(blocks.shape[0], 128).view("<u4"), scale, -offset


def q5_k(blocks: np.ndarray) -> Packed:
    scale, offset = k_scales(blocks)
    return pack_bits(q5_k_codes(blocks).reshape(blocks.shape[0], 256), 5), scale, -offset


def _q5_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 codes (n, 32): low nibbles of the 16 bytes, then their high nibbles; bit i of qh on top."""
    high = (qh.copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    codes = np.concatenate([qs & _NIBBLE, qs >> 4], axis=1)
    return codes | (high.astype(np.uint8) << 4)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def q5_0(blocks: np.ndarray) -> Packed:
    """Q5_0 (n, 22): d * (q - 16), so scale d and bias -16 d."""
    d = _half(blocks, 0)
    return pack_bits(_q5_codes(blocks[:, 2:6], blocks[:, 6:22]), 5), d, d * np.float32(-16.0)


def q5_1(blocks: np.ndarray) -> Packed:
    """Q5_1 (n, 24): d * q + m."""
    return pack_bits(_q5_codes(blocks[:, 4:8], blocks[:, 8:24]), 5), _half(blocks, 0), _half(blocks, 2)


# type -> (block bytes, values per block, bits, repacker)
AFFINE: dict[str, tuple[int, int, int, Callable[[np.ndarray], Packed]]] = {
    "Q4_K": (144, 256, 4, q4_k),
    "Q5_K": (176, 256, 5, q5_k),
    "Q5_0": (22, 32, 5, q5_0),
    "Q5_1": (24, 32, 5, q5_1),
}
