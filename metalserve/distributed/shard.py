"""Tensor parallelism's weights: every layer's heads and MLP columns split over the ranks of a group.

mlx-lm's own `Model.shard(group)` cuts the weights (MLX's `shard_linear` / `shard_inplace`): q, k, v,
gate and up become column-parallel (this rank's heads / columns), o_proj and down_proj row-parallel (this
rank's input columns, then one all-reduce). The attention modules' `n_heads` / `n_kv_heads` become the
per-rank counts, which is what our paged attention and the KV layout read, so each rank's pool holds its
own KV heads. MoE layers (qwen3_moe) split by column: every rank keeps every expert and the router, with
each expert's intermediate columns split (mlx-lm's `shard_inplace` of the SwitchGLU), one all-reduce after.

The sharded layers are then made plain again: a column-parallel layer is an ordinary `nn.Linear` of this
rank's rows (so the loader's dequantize and our q/k/v fusion see the types they know), and every
all-reduce is one `AllSum` module whose byte count is kept (bench/tensor_parallel.py reads it).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)

# mlx-lm model modules whose `shard` splits exactly attention heads and MLP (or MoE) columns, with the
# attention modules our paged attention takes over. Others (hybrid, MLA, vision) are refused by name.
TP_MODULES = ("llama", "qwen2", "qwen3", "qwen3_moe")


class TensorParallelError(ValueError):
    """A model that cannot be split over the group: the message names the flag and why."""


class ReduceMeter:
    """What the all-reduces of the forwards built so far moved: calls and bytes (each rank's input)."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0

    def reset(self) -> None:
        self.calls = self.bytes = 0


METER = ReduceMeter()


class AllSum(nn.Module):
    """A row-parallel projection (or an MoE block of column-split experts): this rank's partial sum, then
    the sum over the group; a bias is added once, after the sum."""

    def __init__(self, inner: nn.Module, group: mx.distributed.Group, bias: mx.array | None = None) -> None:
        super().__init__()
        self.inner = inner
        if bias is not None:
            self.bias = bias
        self.group = group  # not an array: not a parameter

    def __call__(self, x: mx.array, *args: Any) -> mx.array:
        y = mx.distributed.all_sum(self.inner(x, *args), group=self.group)
        METER.calls += 1
        METER.bytes += y.nbytes
        return y + self.bias if "bias" in self else y


def _module_name(model: nn.Module) -> str:
    return type(model).__module__.rsplit(".", 1)[-1]


def tp_problem(model: nn.Module, size: int) -> str | None:
    """Why `model` cannot be split over `size` ranks, or None."""
    name = _module_name(model)
    if name not in TP_MODULES or not hasattr(model, "shard"):
        return (
            f"a {getattr(model, 'model_type', name)} model: tensor parallelism serves {', '.join(TP_MODULES)} "
            "models so far"
        )
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for what, count in (("attention heads", attn.n_heads), ("KV heads", attn.n_kv_heads)):
            if count % size:
                return f"layer {i} has {count} {what}, not divisible by {size}"
        columns = _mlp_columns(layer.mlp)
        if columns % size:
            return f"layer {i}'s MLP has {columns} intermediate columns, not divisible by {size}"
        for proj_name, proj in (("o_proj", attn.o_proj), ("down_proj", _down_proj(layer.mlp))):
            problem = _quantized_split_problem(proj, size)
            if problem:
                return f"layer {i}'s {proj_name}: {problem}"
    return None


def _down_proj(mlp: nn.Module) -> nn.Module:
    return mlp.switch_mlp.down_proj if "switch_mlp" in mlp else mlp.down_proj


def _mlp_columns(mlp: nn.Module) -> int:
    """The intermediate width an MLP (or each expert of an MoE block) splits."""
    if "switch_mlp" in mlp:
        return int(mlp.switch_mlp.gate_proj.weight.shape[-2])
    return int(mlp.gate_proj.weight.shape[0])


def _quantized_split_problem(proj: nn.Module, size: int) -> str | None:
    """A row-parallel quantized layer splits its input columns: each rank's share must be whole groups."""
    bits = getattr(proj, "bits", None)
    if bits is None or "scales" not in proj:
        return None
    in_dims = proj.weight.shape[-1] * 32 // bits
    if (in_dims // size) % proj.group_size or in_dims % size:
        return f"{in_dims} quantized input columns do not split into whole groups of {proj.group_size} over {size}"
    return None


def shard_model(model: nn.Module, group: mx.distributed.Group) -> None:
    """Split `model`'s layers over `group` in place (TensorParallelError if it cannot be)."""
    problem = tp_problem(model, group.size())
    if problem is not None:
        raise TensorParallelError(f"--tensor-parallel-size {group.size()}: {problem}")
    model.shard(group)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, _column(getattr(attn, name)))
        attn.o_proj = _row(attn.o_proj, group)
        if "switch_mlp" in mlp:
            mlp.sharding_group = None  # its all-reduce becomes ours, so it is counted like the others
            layer.mlp = AllSum(mlp, group)
        else:
            mlp.gate_proj, mlp.up_proj = _column(mlp.gate_proj), _column(mlp.up_proj)
            mlp.down_proj = _row(mlp.down_proj, group)


def _column(layer: nn.Module) -> nn.Module:
    """A column-parallel layer as a plain layer of this rank's output rows (its forward is just that)."""
    plain: nn.Module
    if isinstance(layer, AllToShardedLinear):
        plain = nn.Linear(1, 1, bias="bias" in layer)
    elif isinstance(layer, QuantizedAllToShardedLinear):
        plain = _quantized_shell(layer)
    else:
        return layer
    plain.update(layer.parameters())
    return plain


def _row(layer: nn.Module, group: mx.distributed.Group) -> nn.Module:
    """A row-parallel layer as a plain layer of this rank's input columns inside one all-reduce."""
    if isinstance(layer, ShardedToAllLinear):
        plain: nn.Module = nn.Linear(1, 1, bias=False)
    elif isinstance(layer, QuantizedShardedToAllLinear):
        plain = _quantized_shell(layer, bias=False)
    else:
        raise TensorParallelError(f"expected a row-parallel layer after mlx-lm's shard, got {type(layer).__name__}")
    params = dict(layer.parameters())
    bias = params.pop("bias", None)
    plain.update(params)
    return AllSum(plain, group, bias)


def _quantized_shell(like: nn.Module, bias: bool = True) -> nn.QuantizedLinear:
    """An empty QuantizedLinear with `like`'s settings; its arrays come from `like` right after."""
    layer = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
    nn.Module.__init__(layer)
    layer.group_size, layer.bits, layer.mode = like.group_size, like.bits, getattr(like, "mode", "affine")
    layer.weight = like.weight
    layer.scales = like.scales
    if like.get("biases") is not None:
        layer.biases = like.biases
    if bias and "bias" in like:
        layer.bias = like.bias
    layer.freeze()
    return layer
