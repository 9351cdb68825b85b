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

from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
    shard_linear,
)

from metalserve.distributed.subgroup import TensorGroup, reduce_sum
from metalserve.executor.models.families import model_family

# mlx-lm model modules whose `shard` splits exactly attention heads and MLP (or MoE) columns, with the
# attention modules our paged attention takes over; qwen3_5 / qwen3_5_moe (hybrids) also split each gated
# delta net by its key/value heads (conv channels, A_log, dt_bias with them), so each rank's recurrent
# state holds its own heads. Others (qwen3_next's fused projections, MLA, vision) are refused by name.
TP_MODULES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")
# Families mlx-lm has no `shard` for, whose layers are llama's shape (q/k/v/o attention with `n_heads` /
# `n_kv_heads`, a gate/up/down MLP): split here the way llama's `shard` does. gemma3_text brings
# sliding-window layer groups (each rank builds every group's metadata, Stage.context).
OWN_SHARD = ("gemma3_text",)


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

    def __init__(self, inner: nn.Module, group: TensorGroup, bias: mx.array | None = None) -> None:
        super().__init__()
        self.inner = inner
        if bias is not None:
            self.bias = bias
        self.group = group  # not an array: not a parameter

    def __call__(self, x: mx.array, *args: Any) -> mx.array:
        y = reduce_sum(self.inner(x, *args), self.group)
        METER.calls += 1
        METER.bytes += y.nbytes
        return y + self.bias if "bias" in self else y


def _module_name(model: nn.Module) -> str:
    return type(model).__module__.rsplit(".", 1)[-1]


def _layers(model: nn.Module) -> list[nn.Module]:
    return list(model_family(str(getattr(model, "model_type", ""))).backbone(model).layers)


def _heads(attn: nn.Module) -> tuple[int, int]:
    """(query heads, KV heads), as the family spells them."""
    q = attn.n_heads if hasattr(attn, "n_heads") else attn.num_attention_heads
    kv = attn.n_kv_heads if hasattr(attn, "n_kv_heads") else attn.num_key_value_heads
    return int(q), int(kv)


def _mixer_problem(layer: nn.Module, size: int) -> str | None:
    """A layer's token mixer: attention heads, or a gated delta net's key / value heads."""
    if getattr(layer, "is_linear", False):
        la = layer.linear_attn
        counts = (("linear-attention key heads", la.num_k_heads), ("linear-attention value heads", la.num_v_heads))
        out_name, out = "out_proj", la.out_proj
    else:
        q, kv = _heads(layer.self_attn)
        counts = (("attention heads", q), ("KV heads", kv))
        out_name, out = "o_proj", layer.self_attn.o_proj
    for what, count in counts:
        if count % size:
            return f"has {count} {what}, not divisible by {size}"
    problem = _quantized_split_problem(out, size)
    return f"{out_name}: {problem}" if problem else None


def tp_problem(model: nn.Module, size: int) -> str | None:
    """Why `model` cannot be split over `size` ranks, or None."""
    name = _module_name(model)
    if name not in OWN_SHARD and (name not in TP_MODULES or not hasattr(model, "shard")):
        return (
            f"a {getattr(model, 'model_type', name)} model: tensor parallelism serves "
            f"{', '.join(TP_MODULES + OWN_SHARD)} models so far"
        )
    for i, layer in enumerate(_layers(model)):
        problem = _mixer_problem(layer, size)
        if problem:
            return f"layer {i} {problem}" if problem.startswith("has") else f"layer {i}'s {problem}"
        columns = _mlp_columns(layer.mlp)
        if columns % size:
            return f"layer {i}'s MLP has {columns} intermediate columns, not divisible by {size}"
        problem = _quantized_split_problem(_down_proj(layer.mlp), size)
        if problem:
            return f"layer {i}'s down_proj: {problem}"
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


def shard_model(model: nn.Module, group: TensorGroup) -> None:
    """Split `model`'s layers over `group` in place (TensorParallelError if it cannot be)."""
    problem = tp_problem(model, group.size())
    if problem is not None:
        raise TensorParallelError(f"--tensor-parallel-size {group.size()}: {problem}")
    # qwen3_5's shard also splits an untied head by vocabulary (then gathers the logits); rank 0 projects
    # and samples alone, so the head stays whole.
    lm = model_family(str(getattr(model, "model_type", ""))).language_model(model)
    head = lm.lm_head if "lm_head" in lm else None
    if _module_name(model) in OWN_SHARD:
        _shard_dense(model, group)
    else:
        model.shard(group)
    if head is not None:
        lm.lm_head = head
        lm.sharding_group = None
    for layer in _layers(model):
        mlp = layer.mlp
        if getattr(layer, "is_linear", False):
            la = layer.linear_attn  # split in place by mlx-lm (heads, conv channels, A_log, dt_bias)
            la.sharding_group = None  # its all-reduce after out_proj becomes ours (counted)
            la.out_proj = AllSum(la.out_proj, group)
        else:
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(attn, name, _column(getattr(attn, name)))
            attn.o_proj = _row(attn.o_proj, group)
        if "switch_mlp" in mlp:
            mlp.sharding_group = None  # its all-reduce becomes ours, so it is counted like the others
            layer.mlp = AllSum(mlp, group)
        else:
            mlp.gate_proj, mlp.up_proj = _column(mlp.gate_proj), _column(mlp.up_proj)
            mlp.down_proj = _row(mlp.down_proj, group)


def _shard_dense(model: nn.Module, group: TensorGroup) -> None:
    """llama's `shard` for a family without one: heads and MLP columns (the layers made plain after)."""
    n = group.size()
    # shard_linear reads only rank() and size() to slice (the all-reduce becomes ours after), so a
    # PairGroup does for a Group here.
    split = cast("mx.distributed.Group", group)
    for layer in _layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=split))
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=split)
        attn.n_heads //= n
        attn.n_kv_heads //= n
        mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=split)
        mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=split)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=split)


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


def _row(layer: nn.Module, group: TensorGroup) -> nn.Module:
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
