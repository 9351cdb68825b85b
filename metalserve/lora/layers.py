"""The base model's linear layers with a LoRA delta per token, and the table of loaded adapters.

The base matmul runs once over every packed token, as without LoRA. Each layer holds every adapter slot's
A and B stacked (`[max_loras, in, max_rank]`, `[max_loras, max_rank, out]`, zero-padded past an adapter's
rank and zero where an adapter leaves the layer alone), so the delta of all adapter tokens in a step is
one gather of their rows, two gathered matmuls (`mx.gather_mm`, each token through its own slot's A and
B, the rows sorted by slot) and one scatter-add: four ops per projection however many adapters the step
mixes. Tokens under no adapter are not among the rows: a base-only step pays one Python check per layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from metalserve.executor.context import current_context
from metalserve.kernels.cpu.decoder_weights import HostLoraStep
from metalserve.loader.codes_linear import CodesLinear
from metalserve.lora.files import AdapterError, AdapterWeights

# CodesLinear: a GGUF's projections kept in their packed codes on the CPU path (loader/codes_linear.py).
ADAPTABLE = (nn.Linear, nn.QuantizedLinear, CodesLinear)
DELTA_DTYPE = mx.float32  # the adapters' arithmetic (lora/files.py reads them as float32)


@dataclass(frozen=True)
class LoraStep:
    """The step's tokens that run under an adapter: their packed rows, sorted by slot, each one's slot and
    scale (the request's `lora_scale`), as MLX arrays and as the host decoder's NumPy arrays."""

    rows: mx.array  # [n] int32
    slots: mx.array  # [n] uint32
    scales: mx.array  # [n, 1] float32
    host: HostLoraStep
    token_slots: mx.array  # [T] uint32 over every packed token (0 for base tokens; MoE experts read these)
    token_scales: mx.array  # [T] float32 (0 for base tokens: their expert delta is multiplied away)


class LoraLinear(nn.Module):
    """A base linear plus every adapter slot's delta, each applied to its own tokens only."""

    def __init__(self, base: nn.Module, max_loras: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        if isinstance(base, CodesLinear):
            out_dims, in_dims = base.weight_shape
        else:
            out_dims, in_dims = base.weight.shape
        if isinstance(base, nn.QuantizedLinear):
            in_dims = in_dims * 32 // base.bits
        self.in_out: tuple[int, int]
        object.__setattr__(self, "in_out", (int(in_dims), int(out_dims)))  # not a parameter
        self.lora_a = mx.zeros((max_loras, self.in_out[0], max_rank), dtype=DELTA_DTYPE)
        self.lora_b = mx.zeros((max_loras, max_rank, self.in_out[1]), dtype=DELTA_DTYPE)
        self.freeze()

    def set_slot(self, slot: int, delta: tuple[mx.array, mx.array] | None) -> None:
        """Put an adapter's (A [in, r], B [r, out] * scale) into `slot`; None: zero it."""
        self.lora_a[slot] = 0.0
        self.lora_b[slot] = 0.0
        if delta is not None:
            a, b = delta
            rank = a.shape[1]
            self.lora_a[slot, :, :rank] = a
            self.lora_b[slot, :rank, :] = b

    def arrays(self) -> list[mx.array]:
        return [self.lora_a, self.lora_b]

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        step: LoraStep | None = current_context().lora
        if step is None:
            return y
        # x is [1, T, in] (the packed axis behind a batch of one); rows [n] -> [n, 1, in].
        rows = x[0, step.rows][:, None, :].astype(DELTA_DTYPE)
        low = mx.gather_mm(rows, self.lora_a, rhs_indices=step.slots, sorted_indices=True)
        delta = mx.gather_mm(low, self.lora_b, rhs_indices=step.slots, sorted_indices=True)[:, 0, :] * step.scales
        return y.at[:, step.rows].add(delta.astype(y.dtype)[None])


def install_lora_layers(model: nn.Module, max_loras: int, max_rank: int) -> dict[str, LoraLinear]:
    """Wrap every linear of the decoder layers (mlx-lm's module paths, `model.layers.N....`), before the
    paged attention is installed; the paths stay the adapters' keys whatever wraps the modules later."""
    found = [
        (path, module)
        for path, module in model.named_modules()
        if ".layers." in f".{path}" and type(module) in ADAPTABLE
    ]
    wrapped = {path: LoraLinear(module, max_loras, max_rank) for path, module in found}
    model.update_modules(tree_unflatten(list(wrapped.items())))
    return wrapped


class AdapterTarget(Protocol):
    """A linear layer an adapter names by its mlx-lm path: a LoraLinear, or a part of a fused projection
    on the CPU fast path (lora/fused.py: LoraPart)."""

    in_out: tuple[int, int]

    def set_slot(self, slot: int, delta: tuple[mx.array, mx.array] | None) -> None: ...

    def arrays(self) -> list[mx.array]: ...


class LoraSlots:
    """The adapters loaded into a model's adapter targets: name -> slot, at most `max_loras` at once.

    `detached_bytes`: slot memory that is no module's parameter (the fast path's stacks), which the
    engine adds to the weights' bytes itself."""

    def __init__(
        self, layers: Mapping[str, AdapterTarget], max_loras: int, max_rank: int, detached_bytes: int = 0
    ) -> None:
        self.layers = layers
        self.detached_bytes = detached_bytes
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
            experts = getattr(layer, "experts", 0)  # MoE experts (lora/experts.py): A [E, in, r]
            if (a.ndim == 3) != bool(experts) or (experts and a.shape[0] != experts):
                has = f"{a.shape[0]} experts" if a.ndim == 3 else "one dense linear"
                want = f"{experts} experts" if experts else "one dense linear"
                raise AdapterError(f"LoRA adapter {adapter.name!r}: {path} adapts {has}, the model's layer has {want}")
            if (a.shape[-2], b.shape[-1]) != layer.in_out:
                raise AdapterError(
                    f"LoRA adapter {adapter.name!r}: {path} maps {a.shape[-2]} -> {b.shape[-1]}, "
                    f"the model's layer {layer.in_out[0]} -> {layer.in_out[1]}"
                )
        slot = min(set(range(self.max_loras)) - set(self.slots.values()))
        self._fill(slot, adapter)
        self.slots[adapter.name] = slot
        self.adapters[adapter.name] = adapter
        return slot

    def unload(self, name: str) -> None:
        slot = self.slots.pop(name)
        del self.adapters[name]
        self._fill(slot, None)

    def _fill(self, slot: int, adapter: AdapterWeights | None) -> None:
        for path, layer in self.layers.items():
            layer.set_slot(slot, adapter.modules.get(path) if adapter is not None else None)
        mx.eval(list(self._arrays().values()))

    def _arrays(self) -> dict[int, mx.array]:
        return {id(x): x for layer in self.layers.values() for x in layer.arrays()}

    @property
    def nbytes(self) -> int:
        """The slots' bytes (allocated at start-up, whatever is loaded)."""
        return sum(int(x.nbytes) for x in self._arrays().values())


def lora_step(slots: Sequence[int], scales: Sequence[float], cu_seqlens_q: np.ndarray) -> LoraStep | None:
    """The packed rows of the adapters' tokens, sorted by slot: request i (slot `slots[i]`, -1 for the
    base model; its scale `scales[i]`) owns rows `[cu[i], cu[i+1])`. None when every request runs on the
    base model."""
    by_slot: dict[int, list[int]] = {}
    for i, slot in enumerate(slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(i)
    if not by_slot:
        return None
    total = int(cu_seqlens_q[-1])
    token_slots = np.zeros(total, np.uint32)
    token_scales = np.zeros(total, np.float32)
    rows, row_scales, group_start, group_slot = [], [], [0], []
    for slot in sorted(by_slot):
        for i in by_slot[slot]:
            lo, hi = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            rows.append(np.arange(lo, hi, dtype=np.int64))
            row_scales.append(np.full(hi - lo, scales[i], np.float32))
            token_slots[lo:hi] = slot
            token_scales[lo:hi] = scales[i]
        group_start.append(sum(len(r) for r in rows))
        group_slot.append(slot)
    row = np.concatenate(rows)
    scale = np.concatenate(row_scales)
    slot_of_row = np.repeat(np.array(group_slot, np.uint32), np.diff(group_start))
    host = HostLoraStep(row, scale, np.array(group_start, np.int64), np.array(group_slot, np.int64))
    return LoraStep(
        mx.array(row.astype(np.int32)),
        mx.array(slot_of_row),
        mx.array(scale[:, None]),
        host,
        mx.array(token_slots),
        mx.array(token_scales),
    )
