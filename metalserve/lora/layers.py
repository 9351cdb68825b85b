"""The base model's linear layers with a LoRA delta per token, and the table of loaded adapters.

The base matmul runs once over every packed token, as without LoRA. Then, for each adapter present in
the step, its tokens' rows are gathered, multiplied through that adapter's A and B, and added back:
tokens under no adapter take no extra work, and a step without adapter tokens costs one Python check
per layer. The rows per adapter come from the forward context (`LoraStep`), built once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from metalserve.executor.context import current_context
from metalserve.lora.files import AdapterError, AdapterWeights

ADAPTABLE = (nn.Linear, nn.QuantizedLinear)


@dataclass(frozen=True)
class LoraStep:
    """The step's token rows per adapter slot (only slots with tokens this step)."""

    rows: tuple[tuple[int, mx.array], ...]  # (slot, packed token indices [n] int32)


class LoraLinear(nn.Module):
    """A base linear plus the deltas of the adapters loaded into it, applied to their own tokens only."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        # slot -> (A [in, r], B [r, out] * scale); kept out of the parameter tree (not mlx-lm weights).
        self._deltas: dict[int, tuple[mx.array, mx.array]]
        object.__setattr__(self, "_deltas", {})

    @property
    def in_out(self) -> tuple[int, int]:
        out_dims, in_dims = self.base.weight.shape
        if isinstance(self.base, nn.QuantizedLinear):
            in_dims = in_dims * 32 // self.base.bits
        return int(in_dims), int(out_dims)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        if not self._deltas:
            return y
        step: LoraStep | None = current_context().lora
        if step is None:
            return y
        for slot, rows in step.rows:
            delta = self._deltas.get(slot)
            if delta is None:  # this adapter leaves this module alone
                continue
            a, b = delta
            # x is [1, T, in] (the packed axis behind a batch of one).
            part = (x[:, rows].astype(a.dtype) @ a) @ b
            y = y.at[:, rows].add(part.astype(y.dtype))
        return y


def install_lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    """Wrap every linear of the decoder layers (mlx-lm's module paths, `model.layers.N....`), before the
    paged attention is installed; the paths stay the adapters' keys whatever wraps the modules later."""
    found = [
        (path, module)
        for path, module in model.named_modules()
        if ".layers." in f".{path}" and type(module) in ADAPTABLE
    ]
    wrapped = {path: LoraLinear(module) for path, module in found}
    model.update_modules(tree_unflatten(list(wrapped.items())))
    return wrapped


class LoraSlots:
    """The adapters loaded into a model's LoraLinear layers: name -> slot, at most `max_loras` at once."""

    def __init__(self, layers: dict[str, LoraLinear], max_loras: int, max_rank: int) -> None:
        self.layers = layers
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.slots: dict[str, int] = {}  # adapter name -> slot
        self.adapters: dict[str, AdapterWeights] = {}

    def load(self, adapter: AdapterWeights) -> int:
        """Put the adapter's weights into its target layers; AdapterError if it does not fit the model."""
        if adapter.name in self.slots:
            raise AdapterError(f"LoRA adapter {adapter.name!r} is already loaded")
        if len(self.slots) >= self.max_loras:
            raise AdapterError(f"{len(self.slots)} LoRA adapters are loaded, the most --max-loras allows")
        if adapter.rank > self.max_rank:
            raise AdapterError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above --max-lora-rank")
        for path, (a, b) in sorted(adapter.modules.items()):  # the first misfit in layer order
            layer = self.layers.get(path)
            if layer is None:
                raise AdapterError(f"LoRA adapter {adapter.name!r} targets {path}, not a linear layer of this model")
            if (a.shape[0], b.shape[1]) != layer.in_out:
                raise AdapterError(
                    f"LoRA adapter {adapter.name!r}: {path} maps {a.shape[0]} -> {b.shape[1]}, "
                    f"the model's layer {layer.in_out[0]} -> {layer.in_out[1]}"
                )
        slot = min(set(range(self.max_loras)) - set(self.slots.values()))
        for path, delta in adapter.modules.items():
            self.layers[path]._deltas[slot] = delta
        mx.eval([x for pair in adapter.modules.values() for x in pair])
        self.slots[adapter.name] = slot
        self.adapters[adapter.name] = adapter
        return slot

    def unload(self, name: str) -> None:
        slot = self.slots.pop(name)
        del self.adapters[name]
        for layer in self.layers.values():
            layer._deltas.pop(slot, None)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.adapters.values())


def lora_step(slots: Sequence[int], cu_seqlens_q: np.ndarray) -> LoraStep | None:
    """The packed rows of each adapter's tokens: request i (slot `slots[i]`, -1 for the base model) owns
    rows `[cu[i], cu[i+1])`. None when every request runs on the base model."""
    by_slot: dict[int, list[np.ndarray]] = {}
    for i, slot in enumerate(slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(np.arange(cu_seqlens_q[i], cu_seqlens_q[i + 1], dtype=np.int32))
    if not by_slot:
        return None
    return LoraStep(tuple((slot, mx.array(np.concatenate(parts))) for slot, parts in sorted(by_slot.items())))
