"""Choosing and applying the weights path: fp32 at load, or the stored quantized weights."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from metalserve.loader.weights_mode import dequantize_model, fp32_bytes, should_dequantize


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.proj = nn.Linear(32, 64, bias=True)
        self.norm = nn.RMSNorm(32)


@pytest.mark.parametrize(
    ("mode", "size", "metal", "expected"),
    [
        ("auto", 100, False, True),
        ("auto", 101, False, False),  # over the limit: keep quantized
        ("auto", 1, True, False),  # Metal keeps quantized
        ("dequantize", 10**12, True, True),
        ("quantized", 1, False, False),
    ],
)
def test_should_dequantize(mode: str, size: int, metal: bool, expected: bool) -> None:
    assert should_dequantize(mode, size, 100, metal) is expected


def test_unknown_mode() -> None:
    with pytest.raises(ValueError, match="weights must be one of"):
        should_dequantize("fast", 1, 1, False)


def test_fp32_bytes_counts_unpacked_weights() -> None:
    model = _Tiny()
    dense = fp32_bytes(model)
    assert dense == 4 * (64 * 32 + 32 * 64 + 64 + 32)
    nn.quantize(model, group_size=32, bits=4)
    assert isinstance(model.proj, nn.QuantizedLinear)
    assert fp32_bytes(model) == dense


def test_dequantize_model_gives_dense_fp32_layers_with_the_same_output() -> None:
    model = _Tiny()
    nn.quantize(model, group_size=32, bits=4)
    x = mx.array([[1, 5, 63]])
    before = model.proj(model.embed(x))
    dequantize_model(model)
    assert type(model.proj) is nn.Linear and type(model.embed) is nn.Embedding
    assert model.proj.weight.dtype == mx.float32 and "bias" in model.proj
    np.testing.assert_allclose(np.array(model.proj(model.embed(x))), np.array(before), atol=1e-5)


def test_dequantize_model_handles_mxfp4() -> None:
    model = _Tiny()
    nn.quantize(model, group_size=32, bits=4, mode="mxfp4")
    q = model.proj
    expected = mx.dequantize(q.weight, q.scales, None, group_size=32, bits=4, mode="mxfp4")
    dequantize_model(model)
    assert type(model.proj) is nn.Linear and model.proj.weight.dtype == mx.float32
    np.testing.assert_array_equal(np.array(model.proj.weight), np.array(expected.astype(mx.float32)))
