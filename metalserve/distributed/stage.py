"""One rank's slice of the model: its contiguous layers (with paged attention) and their KV pools.

The layers keep mlx-lm's modules; only the slice's layers are kept, numbered from 0 for the local pools,
so block ids mean the same on every rank while each rank stores only its own layers' K/V.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from metalserve.executor.attention.base import AttentionBackend, LayerCacheSpec
from metalserve.executor.context import ForwardContext, GroupStep, forward_context
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.step_inputs import StepInputs
from metalserve.kvcache.specs import AttentionSpec, KVCacheSpec
from metalserve.loader.weights_mode import parameter_bytes


def layer_bytes(model: nn.Module) -> list[int]:
    """Bytes of each decoder layer's parameters (what a rank holding it must store and read per step)."""
    return [parameter_bytes(layer) for layer in model.model.layers]


def non_layer_bytes(model: nn.Module) -> int:
    """Embedding, final norm and vocabulary projection: what rank 0 holds besides its layers."""
    return parameter_bytes(model) - sum(layer_bytes(model))


def keep_layers(model: nn.Module, layers: range, first: bool) -> None:
    """Drop every layer outside `layers` (and, off rank 0, the embedding, norm and head) so they free.

    Off rank 0 the embedding becomes a 1x1 one of the same dtype: the model's family reads the
    activations' dtype from it."""
    backbone = model.model
    backbone.layers = [backbone.layers[i] for i in layers]
    if not first:
        embed = backbone.embed_tokens
        dtype = embed.scales.dtype if isinstance(embed, nn.QuantizedEmbedding) else embed.weight.dtype
        stub = nn.Embedding(1, 1)
        stub.weight = mx.zeros((1, 1), dtype)
        backbone.embed_tokens = stub
        backbone.norm = nn.Identity()
        if "lm_head" in model:
            model.lm_head = nn.Identity()


class Stage:
    """A slice's layers and pools; `forward` runs them on `[T, hidden]` under one step's metadata."""

    def __init__(self, model: PagedModel, spec: KVCacheSpec, backend: AttentionBackend[Any, Any]) -> None:
        self.model = model
        self.spec = spec
        self.backend = backend
        self.kv: list[Any] = [backend.allocate(self._layer(t, spec.num_blocks)) for t in spec.tensors]

    def _layer(self, attn: AttentionSpec, num_blocks: int) -> LayerCacheSpec:
        return LayerCacheSpec(attn, self.spec.block_size, num_blocks)

    def ensure_blocks(self, num_blocks: int) -> None:
        """Grow every local pool to `num_blocks` (rank 0's scheduler grew its pool)."""
        if num_blocks <= self.spec.num_blocks:
            return
        more = num_blocks - self.spec.num_blocks
        tensors = self.spec.tensors
        self.kv = [self.backend.extend(cache, self._layer(t, more)) for cache, t in zip(self.kv, tensors, strict=True)]
        self.spec = self.spec.with_blocks(num_blocks)
        mx.eval([a for layer in self.kv for a in layer.arrays()])
        mx.clear_cache()

    def context(self, step: StepInputs) -> ForwardContext:
        # One layer group (setup.py refuses models of several): group 0's slots and metadata.
        attn = self.spec.groups[0]
        assert isinstance(attn, AttentionSpec)
        meta = self.backend.build_metadata(step, self._layer(attn, self.spec.num_blocks))
        group = GroupStep(mx.array(step.slot_mapping), meta)
        return ForwardContext(mx.array(step.positions), self.backend, self.kv, [group])

    def forward(self, hidden: mx.array, step: StepInputs) -> mx.array:
        """`[T, hidden]` in -> `[T, hidden]` out through this slice's layers (lazy; the caller evaluates)."""
        with forward_context(self.context(step)):
            return run_layers(self.model, hidden)

    def pools(self) -> list[mx.array]:
        return [a for layer in self.kv for a in layer.arrays()]


def run_layers(model: PagedModel, hidden: mx.array) -> mx.array:
    """The slice's decoder layers on the packed axis; paged attention ignores mask and cache."""
    h = hidden[None]
    for layer in model.backbone.layers:
        h = layer(h, None, None)
    return h[0]
