"""Which weights the forward runs on: fp32 (dequantized at load) or the stored quantized ones.

On MLX's CPU backend quantized matmuls run near 2 GFLOP/s while fp32 matmuls through an optimized BLAS
run 10-50x faster, so small models are dequantized once at load. On Metal quantized kernels are fast.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from metalserve.config import WeightsMode
from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.loader.affine_codes import AffineCodes, affine_codes


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of an MLX module's parameters as they sit in memory (packed where quantized)."""
    leaves: list[mx.array] = list(dict(tree_flatten(module.parameters())).values())
    return sum(int(a.nbytes) for a in leaves)


def fp32_bytes(model: nn.Module) -> int:
    """The model's size once every weight is dense fp32 (quantized weights counted unpacked)."""
    total = 0
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
            total += module.weight.size * 32 // module.bits
            if "bias" in module:
                total += module.bias.size
        elif not module.children():
            leaves = dict(tree_flatten(module.parameters())).values()
            total += sum(int(v.size) for v in leaves)
    return 4 * total


def should_dequantize(mode: str, fp32_size: int, max_bytes: int, on_metal: bool) -> bool:
    try:
        mode = WeightsMode(mode)
    except ValueError:
        raise ValueError(f"weights must be one of {', '.join(WeightsMode)}, got {mode!r}") from None
    if mode != WeightsMode.AUTO:
        return mode == WeightsMode.DEQUANTIZE
    return not on_metal and fp32_size <= max_bytes


def _unpack(module: nn.QuantizedLinear | nn.QuantizedEmbedding | QuantizedSwitchLinear) -> mx.array:
    mode = getattr(module, "mode", "affine")
    if mode != "affine":  # mxfp4/nvfp4/mxfp8: uint8 scales, no biases
        return mx.dequantize(module.weight, module.scales, None, module.group_size, module.bits, mode=mode)
    # fp32 scales and biases: dequantizing in their stored fp16 would round every weight to fp16.
    assert module.biases is not None
    scales, biases = module.scales.astype(mx.float32), module.biases.astype(mx.float32)
    return mx.dequantize(module.weight, scales, biases, module.group_size, module.bits)


def _dense_switch_twin(module: QuantizedSwitchLinear) -> SwitchLinear:
    """MoE experts (mlx-lm's SwitchGLU projections), stacked [experts, out, in]."""
    w = _unpack(module)
    experts, out_dims, in_dims = w.shape
    twin = SwitchLinear(in_dims, out_dims, experts, bias="bias" in module)
    twin.weight = w.astype(mx.float32)
    if "bias" in module:
        twin.bias = module.bias.astype(mx.float32)
    return twin


def _dense_weights(module: nn.QuantizedLinear | nn.QuantizedEmbedding, codes: AffineCodes | None) -> mx.array:
    """fp32 weights: from the codes in NumPy where the loader has them (faster than MLX's CPU dequantize;
    the same values: scale * q is exact in fp32, so only the bias adds a rounding, as in MLX), else MLX."""
    if codes is None:
        return _unpack(module)
    rows, cols = codes.codes.shape
    groups = codes.scales.shape[1]
    w = codes.codes.reshape(rows, groups, cols // groups).astype(np.float32)
    w *= codes.scales[:, :, None]
    w += codes.biases[:, :, None]
    return mx.array(w.reshape(rows, cols))


def _dense_twin(module: nn.Module, codes: AffineCodes | None = None) -> nn.Module:
    if isinstance(module, QuantizedSwitchLinear):
        return _dense_switch_twin(module)
    if isinstance(module, nn.QuantizedLinear):
        w = _dense_weights(module, codes)
        has_bias = "bias" in module
        out_dims, in_dims = w.shape
        linear = nn.Linear(in_dims, out_dims, bias=has_bias)
        linear.weight = w.astype(mx.float32)
        if has_bias:
            linear.bias = module.bias.astype(mx.float32)
        return linear
    if isinstance(module, nn.QuantizedEmbedding):
        w = _dense_weights(module, codes)
        emb = nn.Embedding(*w.shape)
        emb.weight = w.astype(mx.float32)
        return emb
    return module


def _packed(module: nn.QuantizedLinear | nn.QuantizedEmbedding, found: AffineCodes) -> PackedCodes | None:
    try:
        return PackedCodes.pack(found.codes, found.scales, found.biases, module.bits)
    except ValueError:  # a width or group size the packing has no room for: no host path for this layer
        return None


def dequantize_model(model: nn.Module, keep_codes: bool = False) -> dict[str, PackedCodes]:
    """Replace every quantized layer by its dense fp32 twin, in place. With `keep_codes`, return each
    replaced layer's stored integer codes, packed, by its module path (e.g. `model.layers.0.mlp.down_proj`), where
    its mode has them; the host path reads them (executor/host/)."""
    codes: dict[str, PackedCodes] = {}
    by_module: dict[int, AffineCodes] = {}  # unpacked once, for the twin and for the host path
    for path, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            found = affine_codes(module)
            if found is not None:
                by_module[id(module)] = found
                packed = _packed(module, found) if keep_codes else None
                if packed is not None:
                    codes[path] = packed
    leaves = tree_map(lambda m: _dense_twin(m, by_module.get(id(m))), model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)
    return codes


def cast_floats(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast every floating-point parameter (norms, scales, biases, dense weights) to `dtype`."""

    def cast(p: mx.array) -> mx.array:
        return p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p

    model.update(tree_map(cast, model.parameters()))
