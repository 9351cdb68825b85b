"""The stored codes of dequantized weights, and the numba matmul that reads them."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from metalserve.kernels.cpu.affine_linear import affine_linear
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


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 16, 33])
def test_affine_linear_matches_a_dense_matmul(rows: int) -> None:
    codes = affine_codes(quantized_linear(37, 96, 32, 4))  # 37 outputs: chunks do not divide evenly
    assert codes is not None
    x = np.random.default_rng(rows).standard_normal((rows, 96)).astype(np.float32)
    want = x.astype(np.float64) @ codes.dense().astype(np.float64).T
    np.testing.assert_allclose(affine_linear(x, codes), want, rtol=1e-4, atol=1e-4)
    # A strided view gives the same answer as its contiguous copy.
    wide = np.repeat(x, 2, axis=1)[:, ::2]
    np.testing.assert_allclose(affine_linear(wide, codes), want, rtol=1e-4, atol=1e-4)


def test_affine_linear_rejects_a_wrong_width_or_dtype() -> None:
    codes = affine_codes(quantized_linear(8, 64, 32, 4))
    assert codes is not None
    with pytest.raises(ValueError, match=r"\[T, 64\] float32"):
        affine_linear(np.zeros((2, 32), np.float32), codes)
    with pytest.raises(ValueError, match="float32"):
        affine_linear(np.zeros((2, 64), np.float64), codes)
