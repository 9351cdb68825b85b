"""The integer codes of MLX affine-quantized weights, as the loader unpacks them (packed again in
tests/kernels/test_packed_codes.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from metalserve.loader.affine_codes import AffineCodes, affine_codes


def quantized_linear(out_dims: int, in_dims: int, group_size: int, bits: int, seed: int = 0) -> nn.QuantizedLinear:
    linear = nn.Linear(in_dims, out_dims, bias=False)
    linear.weight = mx.random.normal((out_dims, in_dims), key=mx.random.key(seed))
    return nn.QuantizedLinear.from_linear(linear, group_size=group_size, bits=bits)


@pytest.mark.parametrize(("group_size", "bits"), [(32, 4), (32, 8), (64, 4), (64, 2)])
def test_codes_stand_for_the_dequantized_weights(group_size: int, bits: int) -> None:
    layer = quantized_linear(24, 128, group_size, bits)
    codes = affine_codes(layer)
    assert codes is not None and codes.group_size == group_size
    assert codes.codes.max() < 2**bits and codes.codes.shape == (24, 128)
    want = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size, bits)
    np.testing.assert_allclose(codes.dense(), np.array(want), rtol=1e-6, atol=1e-6)


def test_modes_without_codes_give_none() -> None:
    layer = quantized_linear(8, 64, 32, 4)
    layer.mode = "mxfp4"
    assert affine_codes(layer) is None


def test_codes_concatenate_by_rows_and_refuse_mixed_groups() -> None:
    a, b = (affine_codes(quantized_linear(8, 64, 32, 4, seed=s)) for s in (1, 2))
    assert a is not None and b is not None
    both = AffineCodes.concatenate([a, b])
    assert both is not None
    np.testing.assert_array_equal(both.dense(), np.concatenate([a.dense(), b.dense()]))
    other = affine_codes(quantized_linear(8, 64, 64, 4))
    assert other is not None and AffineCodes.concatenate([a, other]) is None


def test_codes_check_their_shapes_and_dtypes() -> None:
    codes = np.zeros((4, 64), np.uint8)
    with pytest.raises(ValueError, match="uint8"):
        AffineCodes(codes.astype(np.int32), np.ones((4, 2), np.float32), np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match="do not group"):
        AffineCodes(codes, np.ones((4, 3), np.float32), np.zeros((4, 3), np.float32))
