"""NumPy's unpacking of MLX-packed affine codes equals MLX's own dequantization, for every bit width."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from metalserve.loader.affine_codes import affine_codes, unpack_codes
from metalserve.loader.weights_mode import dequantize_model


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_codes_and_dense_weights_equal_mlx_dequantize(bits: int) -> None:
    mx.random.seed(bits)
    layer = nn.Linear(256, 48)
    quantized = nn.QuantizedLinear.from_linear(layer, group_size=32, bits=bits)
    ones, zeros = mx.ones_like(quantized.scales), mx.zeros_like(quantized.scales)
    want_codes = mx.dequantize(quantized.weight, ones, zeros, group_size=32, bits=bits).astype(mx.uint8)
    assert np.array_equal(unpack_codes(np.array(quantized.weight), bits), np.array(want_codes))
    scales, biases = quantized.scales.astype(mx.float32), quantized.biases.astype(mx.float32)
    want = np.array(mx.dequantize(quantized.weight, scales, biases, group_size=32, bits=bits))
    model = nn.Sequential(quantized)
    codes = dequantize_model(model, keep_codes=True)
    assert isinstance(model.layers[0], nn.Linear) and np.array_equal(np.array(model.layers[0].weight), want)
    found = affine_codes(quantized)
    assert found is not None and np.array_equal(codes["layers.0"].unpacked(), found.codes)
