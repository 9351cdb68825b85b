"""Fuse the q, k and v projections into one matmul: one op instead of three on every layer."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def fuse_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One layer whose output is the concatenation of `layers`' outputs, or None if they cannot fuse.

    Dense and quantized linears fuse when they share their type, bias use and quantization settings;
    linears kept in their codes (CPU path) fuse as a list of their row blocks.
    """
    from metalserve.loader.codes_linear import CodesLinear

    first = layers[0]
    if any(type(layer) is not type(first) for layer in layers):
        return None
    if type(first) is CodesLinear:
        return CodesLinear.fuse(layers)  # type: ignore[arg-type]
    has_bias = "bias" in first
    if any(("bias" in layer) != has_bias for layer in layers):
        return None
    fused: nn.Linear | nn.QuantizedLinear
    if type(first) is nn.Linear:
        out_dims = sum(layer.weight.shape[0] for layer in layers)
        fused = nn.Linear(first.weight.shape[1], out_dims, bias=has_bias)
    elif type(first) is nn.QuantizedLinear:
        settings = {(layer.group_size, layer.bits, getattr(layer, "mode", "affine")) for layer in layers}
        if len(settings) != 1 or first.get("biases") is None:
            return None
        fused = _empty_quantized(first, sum(layer.weight.shape[0] for layer in layers))
        fused.scales = mx.concatenate([layer.scales for layer in layers], axis=0)
        fused.biases = mx.concatenate([layer.biases for layer in layers], axis=0)
    else:
        return None
    fused.weight = mx.concatenate([layer.weight for layer in layers], axis=0)
    if has_bias:
        fused.bias = mx.concatenate([layer.bias for layer in layers], axis=0)
    return fused


def _empty_quantized(like: nn.QuantizedLinear, out_dims: int) -> nn.QuantizedLinear:
    """A QuantizedLinear shell with `like`'s settings; its arrays are replaced right after."""
    layer = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
    nn.Module.__init__(layer)
    layer.group_size, layer.bits = like.group_size, like.bits
    if hasattr(like, "mode"):
        layer.mode = like.mode
    layer.freeze()
    return layer
