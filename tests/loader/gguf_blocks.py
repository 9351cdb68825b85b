"""Tensors encoded in any ggml type, with what a correct reader decodes them to (gguf's dequantizer).

gguf 0.19 quantizes Q4_0..Q8_0, Q5_0/Q5_1 and BF16 but only dequantizes the K-quants, so K-quant
tensors are random blocks of the right byte layout whose fp16 scale fields are set to finite values.
"""

from __future__ import annotations

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
# Byte offsets of each K-quant block's fp16 fields (d, dmin) and a scale for d giving weights of std ~0.15.
_HALF_FIELDS = {
    T.Q2_K: ((80, 82), 1.5e-2),
    T.Q3_K: ((108,), 4.5e-3),
    T.Q4_K: ((0, 2), 8.5e-4),
    T.Q5_K: ((0, 2), 4.3e-4),
    T.Q6_K: ((208,), 1.5e-4),
}
K_QUANTS = tuple(_HALF_FIELDS)


def random_k_blocks(shape: tuple[int, ...], kind: T, rng: np.random.Generator) -> np.ndarray:
    """Random valid `kind` blocks for a tensor of numpy shape `shape` (the last axis whole blocks)."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    offsets, scale = _HALF_FIELDS[kind]
    for off in offsets:
        half = (rng.uniform(0.5, 1.0, blocks.shape[:-1]) * scale).astype(np.float16)
        blocks[..., off : off + 2] = half[..., None].view(np.uint8).reshape(*half.shape, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


def encode(w: np.ndarray, kind: T, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(what to hand GGUFWriter.add_tensor, the fp32 values a reader must decode). K-quants ignore `w`'s
    values (only its shape counts), as gguf cannot quantize to them."""
    if kind == T.F32:
        return w.astype(np.float32), w.astype(np.float32)
    if kind == T.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    data = random_k_blocks(w.shape, kind, rng) if kind in K_QUANTS else gguf.quants.quantize(w.astype(np.float32), kind)
    return data, gguf.quants.dequantize(data, kind).astype(np.float32)


def add_encoded(writer: gguf.GGUFWriter, name: str, data: np.ndarray, kind: T) -> None:
    if kind in (T.F32, T.F16):
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
