"""LoRA adapters on the CPU fast path: deltas on the host model's fused projections.

On MLX's CPU backend the host compute (executor/host/) fuses q, k and v into one projection and gate and
up into another, keeps them in their packed codes and runs every layer in one numba call. The adapters
follow that layout instead of undoing it: each (fused) projection kind has one stack of every layer's
slots, A `[L, slots, in, parts * R]` and B transposed `[L, slots, out, R]` (part p: ranks
`p * R:(p + 1) * R` of A, its own output rows of B's transpose). The stacks are MLX arrays with
writable NumPy views over the same memory: loading an adapter writes through the views, and both
readers see it at once, the numba decoder
(kernels/cpu/lora.py, a delta per slot group of the step's adapter tokens) and, for steps the decoder
does not take, `FusedLoraLinear` on the MLX route (gathered matmuls, as lora/layers.py's LoraLinear).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.executor.context import current_context
from metalserve.executor.host.linear import HostLinear
from metalserve.executor.models.adapter import PagedModel
from metalserve.kernels.cpu.decoder_weights import DecoderLora, LoraProjection
from metalserve.loader.codes_linear import CodesLinear
from metalserve.lora.layers import DELTA_DTYPE

logger = logging.getLogger("metalserve.engine")

_PROJECTIONS = (nn.Linear, nn.QuantizedLinear, CodesLinear, HostLinear)
# The host decoder's four projections, by their module path in a host-compute layer.
_DECODER_KINDS = {
    "self_attn.qkv_proj": "qkv",
    "self_attn.inner.o_proj": "o",
    "mlp.gate_up_proj": "gate_up",
    "mlp.inner.down_proj": "down",
}


class LoraStack:
    """One projection kind's adapter slots in `layers` layers, as MLX arrays and NumPy views of them."""

    def __init__(self, layers: int, max_loras: int, max_rank: int, in_dims: int, part_outs: tuple[int, ...]) -> None:
        self.rank = max_rank
        self.in_dims = in_dims
        self.part_outs = part_outs
        self.bounds = np.cumsum([0, *part_outs]).astype(np.int64)
        self.a = mx.zeros((layers, max_loras, in_dims, len(part_outs) * max_rank), dtype=DELTA_DTYPE)
        self.bt = mx.zeros((layers, max_loras, int(self.bounds[-1]), max_rank), dtype=DELTA_DTYPE)
        mx.eval(self.a, self.bt)
        self.host_a, self.host_bt = np.asarray(self.a), np.asarray(self.bt)
        # Writes go through these views: they must be the arrays' own memory, not copies.
        for view in (self.host_a, self.host_bt):
            if not (view.flags.writeable and view.flags.c_contiguous):
                raise RuntimeError("MLX's array memory cannot be written through NumPy here")

    def projection(self) -> LoraProjection:
        return LoraProjection(self.host_a, self.host_bt, self.bounds)

    @property
    def nbytes(self) -> int:
        return int(self.a.nbytes + self.bt.nbytes)


class LoraPart:
    """What an adapter names (`model.layers.3.self_attn.k_proj`): one part of one layer's fused projection."""

    def __init__(self, stack: LoraStack, layer: int, part: int) -> None:
        self.stack, self.layer, self.part = stack, layer, part
        self.in_out = (stack.in_dims, stack.part_outs[part])

    def set_slot(self, slot: int, delta: tuple[mx.array, mx.array] | None) -> None:
        """Put an adapter's (A [in, r], B [r, out] * scale) into `slot`; None: zero it."""
        r0, c0, c1 = (
            self.part * self.stack.rank,
            int(self.stack.bounds[self.part]),
            int(self.stack.bounds[self.part + 1]),
        )
        a, bt = self.stack.host_a[self.layer, slot], self.stack.host_bt[self.layer, slot]
        a[:, r0 : r0 + self.stack.rank] = 0.0
        bt[c0:c1, :] = 0.0
        if delta is not None:
            rank = delta[0].shape[1]
            a[:, r0 : r0 + rank] = np.asarray(delta[0].astype(DELTA_DTYPE))
            bt[c0:c1, :rank] = np.asarray(delta[1].astype(DELTA_DTYPE)).T

    def arrays(self) -> list[mx.array]:
        return [self.stack.a, self.stack.bt]


class FusedLoraLinear(nn.Module):
    """A (fused) projection of the host model plus its layer's slots of `stack`, on the MLX route."""

    def __init__(self, base: nn.Module, stack: LoraStack, layer: int) -> None:
        super().__init__()
        self.base = base
        object.__setattr__(self, "stack", stack)  # shared by every layer: not this module's parameter
        object.__setattr__(self, "layer", layer)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        step = current_context().lora
        if step is None:
            return y
        stack: LoraStack = self.stack
        rank, bounds = stack.rank, stack.bounds
        rows = x[0, step.rows][:, None, :].astype(DELTA_DTYPE)
        low = mx.gather_mm(rows, stack.a[self.layer], rhs_indices=step.slots, sorted_indices=True)
        bt = stack.bt[self.layer]
        parts = [
            mx.gather_mm(
                low[..., p * rank : (p + 1) * rank],
                bt[:, int(bounds[p]) : int(bounds[p + 1]), :].swapaxes(-1, -2),
                rhs_indices=step.slots,
                sorted_indices=True,
            )
            for p in range(len(bounds) - 1)
        ]
        delta = (parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1))[:, 0, :] * step.scales
        return y.at[:, step.rows].add(delta.astype(y.dtype)[None])


def _dims(module: nn.Module) -> tuple[int, int]:
    """(in, out) of a projection."""
    if isinstance(module, HostLinear):
        return module.codes[0].columns, sum(p.shape[0] for p in module.codes)
    if isinstance(module, CodesLinear):
        out_dims, in_dims = module.weight_shape
        return int(in_dims), int(out_dims)
    out_dims, in_dims = module.weight.shape
    if isinstance(module, nn.QuantizedLinear):
        in_dims = in_dims * 32 // module.bits
    return int(in_dims), int(out_dims)


def _parts(layer: nn.Module, rel: str, out_dims: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The adapter module names (mlx-lm's, relative to the layer) a projection stands for, and their widths."""
    attn = layer.self_attn
    if rel == "self_attn.qkv_proj":
        q, kv = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
        if q + 2 * kv == out_dims:
            return ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), (q, kv, kv)
    if rel == "mlp.gate_up_proj":
        return ("mlp.gate_proj", "mlp.up_proj"), (out_dims // 2, out_dims // 2)
    return (rel.replace(".inner.", "."),), (out_dims,)


def install_fused_lora(model: PagedModel, max_loras: int, max_rank: int) -> tuple[dict[str, LoraPart], int]:
    """Wrap every projection of the host model's decoder layers with its slots; the adapters' module
    paths (mlx-lm's) map to their parts. Returns those, and the stacks' bytes (not module parameters).
    Gives the host decoder its stacks, or, where a projection is not among the four it reads, turns it off
    (such a model then runs every step on the MLX route)."""
    found: dict[str, list[tuple[int, nn.Module, str, nn.Module]]] = {}  # rel path -> (layer, owner, attr, module)
    for i, layer in enumerate(model.backbone.layers):
        for rel, module in layer.named_modules():
            if not isinstance(module, _PROJECTIONS):
                continue
            owner_path, _, attr = rel.rpartition(".")
            owner = layer if not owner_path else _module_at(layer, owner_path)
            if isinstance(owner, HostLinear):  # the fp32 copy a HostLinear keeps for large steps
                continue
            found.setdefault(rel, []).append((i, owner, attr, module))
    targets: dict[str, LoraPart] = {}
    stacks: dict[str, LoraStack] = {}
    layers = model.backbone.layers
    for rel, uses in sorted(found.items()):
        shapes = {(_dims(m)[0], _parts(layers[i], rel, _dims(m)[1])) for i, _, _, m in uses}
        shared = len(shapes) == 1 and len(uses) == len(layers)
        for i, owner, attr, module in uses:
            in_dims, out_dims = _dims(module)
            names, outs = _parts(layers[i], rel, out_dims)
            if shared and rel not in stacks:
                stacks[rel] = LoraStack(len(layers), max_loras, max_rank, in_dims, outs)
            stack = stacks[rel] if shared else LoraStack(1, max_loras, max_rank, in_dims, outs)
            index = i if shared else 0
            setattr(owner, attr, FusedLoraLinear(module, stack, index))
            for p, name in enumerate(names):
                targets[f"model.layers.{i}.{name}"] = LoraPart(stack, index, p)
    _give_decoder(model, stacks, set(found))
    held = {id(part.stack): part.stack.nbytes for part in targets.values()}
    return targets, sum(held.values())


def _module_at(root: nn.Module, path: str) -> nn.Module:
    module = root
    for name in path.split("."):
        module = getattr(module, name)
    return module


def _give_decoder(model: PagedModel, stacks: dict[str, LoraStack], kinds: set[str]) -> None:
    host = getattr(model.compute, "forward_on_host", None)
    if host is None:
        return
    if kinds == set(_DECODER_KINDS) and set(stacks) == kinds:
        host.lora = DecoderLora(**{_DECODER_KINDS[rel]: stack.projection() for rel, stack in stacks.items()})
        return
    logger.info("--enable-lora: this model's projections do not all reach the host decoder; it runs on MLX")
    model.compute.forward_on_host = None  # type: ignore[attr-defined]
