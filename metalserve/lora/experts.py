"""LoRA adapters on MoE experts: mlx-lm's `LoRASwitchLinear` (one A and B per expert of a SwitchGLU's
gate, up and down projections), served per token beside the dense adapters of lora/layers.py.

Each projection holds every slot's experts flattened, A `[slots * E, in, R]` and B `[slots * E, R, out]`, so a
routed token-expert pair `(token, e)` reads pair `slot(token) * E + e`: one gathered matmul for A and one
for B per projection whatever the mix of adapters. The expert rows are permuted by the router (sorted by
expert when many), so the delta runs over every routed pair of a step that has adapter tokens, with the
base tokens' pairs at scale 0; a step without adapter tokens runs mlx-lm's SwitchGLU as it is.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

from metalserve.executor.context import current_context
from metalserve.lora.layers import DELTA_DTYPE


class LoraSwitchLinear(nn.Module):
    """A SwitchLinear (one weight per expert) plus every slot's per-expert A and B."""

    def __init__(self, base: SwitchLinear | QuantizedSwitchLinear, max_loras: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.experts: int
        self.in_out: tuple[int, int]
        object.__setattr__(self, "experts", int(base.num_experts))  # not parameters
        object.__setattr__(self, "in_out", (int(base.input_dims), int(base.output_dims)))
        pairs = max_loras * self.experts
        self.lora_a = mx.zeros((pairs, self.in_out[0], max_rank), dtype=DELTA_DTYPE)
        self.lora_b = mx.zeros((pairs, max_rank, self.in_out[1]), dtype=DELTA_DTYPE)
        self.freeze()

    def set_slot(self, slot: int, delta: tuple[mx.array, mx.array] | None) -> None:
        """Put an adapter's (A [E, in, r], B [E, r, out] * scale) into `slot`; None: zero it."""
        first, last = slot * self.experts, (slot + 1) * self.experts
        self.lora_a[first:last] = 0.0
        self.lora_b[first:last] = 0.0
        if delta is not None:
            a, b = delta
            rank = a.shape[2]
            self.lora_a[first:last, :, :rank] = a
            self.lora_b[first:last, :rank, :] = b

    def arrays(self) -> list[mx.array]:
        return [self.lora_a, self.lora_b]

    def __call__(
        self, x: mx.array, indices: mx.array, sorted_indices: bool, pairs: mx.array | None, scales: mx.array | None
    ) -> mx.array:
        """mlx-lm's LoRASwitchLinear with each routed pair's own slot (`pairs`) and scale (`scales`);
        None: the base projection alone."""
        y = self.base(x, indices, sorted_indices=sorted_indices)
        if pairs is None or scales is None:
            return y
        low = mx.gather_mm(x.astype(DELTA_DTYPE), self.lora_a, rhs_indices=pairs)
        delta = mx.gather_mm(low, self.lora_b, rhs_indices=pairs)
        return y + (delta * scales).astype(y.dtype)


class LoraSwitchGLU(nn.Module):
    """mlx-lm's SwitchGLU whose three projections carry expert adapters (the same module names, so the
    adapters' paths `...switch_mlp.gate_proj` stay mlx-lm's)."""

    def __init__(self, inner: SwitchGLU, max_loras: int, max_rank: int) -> None:
        super().__init__()
        self.gate_proj = LoraSwitchLinear(inner.gate_proj, max_loras, max_rank)
        self.up_proj = LoraSwitchLinear(inner.up_proj, max_loras, max_rank)
        self.down_proj = LoraSwitchLinear(inner.down_proj, max_loras, max_rank)
        self.activation = inner.activation

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """SwitchGLU.__call__ (mlx-lm's), each routed pair also through its token's adapter slot."""
        step = current_context().lora
        pairs = scales = None
        if step is not None:  # x is [1, T, D], indices [1, T, k]: each routed pair's adapter pair and scale
            pairs = step.token_slots[None, :, None] * self.gate_proj.experts + indices.astype(mx.uint32)
            scales = mx.broadcast_to(step.token_scales[None, :, None], indices.shape)
        x = mx.expand_dims(x, (-2, -3))
        do_sort = indices.size >= 64  # as SwitchGLU: many pairs run sorted by expert
        idx, inv_order = indices, None
        if do_sort:
            order = mx.argsort(indices.flatten())
            inv_order = mx.argsort(order)
            x, idx = x.flatten(0, -3)[order // indices.shape[-1]], indices.flatten()[order]
            if pairs is not None and scales is not None:
                pairs, scales = pairs.flatten()[order], scales.flatten()[order]
        scales = scales[..., None, None] if scales is not None else None
        x_up = self.up_proj(x, idx, do_sort, pairs, scales)
        x_gate = self.gate_proj(x, idx, do_sort, pairs, scales)
        out = self.down_proj(self.activation(x_up, x_gate), idx, do_sort, pairs, scales)
        if inv_order is not None:
            out = mx.unflatten(out[inv_order], 0, indices.shape)
        return out.squeeze(-2)


def install_expert_layers(model: nn.Module, max_loras: int, max_rank: int) -> dict[str, LoraSwitchLinear]:
    """Replace every SwitchGLU of the decoder layers; the expert projections by their mlx-lm paths."""
    found = [(path, m) for path, m in model.named_modules() if ".layers." in f".{path}" and type(m) is SwitchGLU]
    wrapped = {path: LoraSwitchGLU(module, max_loras, max_rank) for path, module in found}
    if wrapped:
        from mlx.utils import tree_unflatten

        model.update_modules(tree_unflatten(list(wrapped.items())))
    return {
        f"{path}.{name}": getattr(glu, name)
        for path, glu in wrapped.items()
        for name in ("gate_proj", "up_proj", "down_proj")
    }
