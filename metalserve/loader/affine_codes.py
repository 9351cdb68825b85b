"""Extract the stored integer codes of an affine-quantized MLX layer (see metalserve/kernels/affine_codes.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.kernels.affine_codes import AffineCodes

__all__ = ["AffineCodes", "affine_codes"]


def affine_codes(module: nn.QuantizedLinear | nn.QuantizedEmbedding) -> AffineCodes | None:
    """The codes of an affine-quantized layer of up to 8 bits; None for other modes."""
    biases = module.get("biases")
    if getattr(module, "mode", "affine") != "affine" or module.bits > 8 or biases is None:
        return None
    scales = module.scales.astype(mx.float32)
    # Dequantizing with unit scales and zero biases unpacks the integers, whatever MLX's bit packing.
    codes = mx.dequantize(module.weight, mx.ones_like(scales), mx.zeros_like(scales), module.group_size, module.bits)
    return AffineCodes(
        np.array(codes.astype(mx.uint8)), np.array(scales), np.array(biases.astype(mx.float32))
    )
