"""One rank's slice of the model: its contiguous layers (with paged attention) and their KV pools.

The layers keep mlx-lm's modules; only the slice's layers are kept, numbered from 0 for the local pools.
Every layer group of the whole model stays in the slice's KV spec (models/kv_layout.py `stage_layout`):
block ids and each group's block table mean the same on every rank, while each rank stores only its
own layers' K/V pages and recurrent states.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from metalserve.distributed.wire import StepMeta
from metalserve.executor.attention.base import AttentionBackend, LayerCacheSpec
from metalserve.executor.block_table import BlockTables
from metalserve.executor.context import ForwardContext, GroupStep, forward_context
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.models.attention_traits import FIRST_LAYER_ATTR
from metalserve.executor.models.families import model_family
from metalserve.executor.state_cache import RecurrentStates
from metalserve.kvcache.specs import AttentionSpec, KVCacheSpec
from metalserve.loader.weights_mode import parameter_bytes

# The backbone's final norm, by the names mlx-lm's families give it (lfm2: embedding_norm, nemotron_h: norm_f).
FINAL_NORMS = ("norm", "embedding_norm", "norm_f")


def backbone_of(model: nn.Module) -> nn.Module:
    """An mlx-lm model's backbone (embedding, decoder layers, final norm), wherever its family keeps it."""
    return model_family(str(getattr(model, "model_type", ""))).backbone(model)


def layer_bytes(model: nn.Module) -> list[int]:
    """Bytes of each decoder layer's parameters (what a rank holding it must store and read per step)."""
    return [parameter_bytes(layer) for layer in backbone_of(model).layers]


def non_layer_bytes(model: nn.Module) -> int:
    """Embedding, final norm and vocabulary projection: what rank 0 holds besides its layers."""
    return parameter_bytes(model) - sum(layer_bytes(model))


def final_norm_name(backbone: nn.Module) -> str:
    for name in FINAL_NORMS:
        if name in backbone:
            return name
    raise ValueError(f"{type(backbone).__name__} has none of the final norms {FINAL_NORMS}")


def keep_layers(model: nn.Module, layers: range, first: bool) -> None:
    """Drop every layer outside `layers` (and, off rank 0, the embedding, norm and head) so they free.

    Off rank 0 the embedding becomes a one-row one of the same dtype and width: the model's family reads
    the activations' dtype (and a hybrid's state probe their width) from it. The backbone remembers the
    whole model's index of its first layer, where per-model lists (`layer_types`) are read by layer
    (models/attention_traits.py)."""
    family = model_family(str(getattr(model, "model_type", "")))
    backbone = family.backbone(model)
    backbone.layers = [backbone.layers[i] for i in layers]
    setattr(backbone, FIRST_LAYER_ATTR, layers.start)
    if not first:
        embed = getattr(backbone, family.embedding_attr)
        quantized = isinstance(embed, nn.QuantizedEmbedding)
        dtype = embed.scales.dtype if quantized else embed.weight.dtype
        hidden = int(embed.dims) if quantized else int(embed.weight.shape[1])
        stub = nn.Embedding(1, hidden)
        stub.weight = mx.zeros((1, hidden), dtype)
        setattr(backbone, family.embedding_attr, stub)
        setattr(backbone, final_norm_name(backbone), nn.Identity())
        lm = family.language_model(model)
        if "lm_head" in lm:
            lm.lm_head = nn.Identity()


def embed_inputs(model: PagedModel, token_ids: mx.array) -> mx.array:
    """`[T]` token ids -> `[T, hidden]`: what mlx-lm's backbone feeds its first layer."""
    return model.family.embed_inputs(model.embed(token_ids), model.backbone)


def final_norm(model: PagedModel, hidden: mx.array) -> mx.array:
    """The backbone's final norm (rank 0 applies it to the last rank's rows before the head)."""
    norm: nn.Module = getattr(model.backbone, final_norm_name(model.backbone))
    return norm(hidden)


class Stage:
    """A slice's layers and pools; `forward` runs them on `[T, hidden]` under one step's metadata."""

    def __init__(self, model: PagedModel, spec: KVCacheSpec, backend: AttentionBackend[Any, Any]) -> None:
        self.model = model
        self.spec = spec
        self.backend = backend
        self.kv: list[Any] = [backend.allocate(self._layer(t, spec.num_blocks)) for t in spec.tensors]
        self.local_groups = frozenset(model.kv_layout.layer_group) - {-1}  # the groups this slice's layers use
        self.states: RecurrentStates | None = None  # the slice's recurrent layers' states, by block id
        if model.state_layout is not None:  # its tables are each step's (`context`)
            tables = BlockTables(spec.groups, spec.block_size)
            self.states = RecurrentStates(model.state_layout, tables, spec.num_blocks)

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
        if self.states is not None:
            self.states.pool.grow(num_blocks)
        mx.eval(self.pools())
        mx.clear_cache()

    def context(self, meta: StepMeta) -> ForwardContext:
        """Every layer group's slots and metadata (and the recurrent states' plan) from the step's tables;
        a stage keeps no request state, so the tables are the step's, under row numbers for request ids."""
        tables = BlockTables(self.spec.groups, self.spec.block_size)
        rids = [str(i) for i in range(len(meta.seq_lens))]
        for i, rid in enumerate(rids):
            tables.add_request(rid, [group[i].tolist() for group in meta.tables()])
        step = meta.step_inputs(rids)
        groups = []
        for g in tables.attention_groups:
            if g not in self.local_groups:  # no layer here reads it: skip its slots and metadata
                groups.append(GroupStep(mx.zeros((0,), mx.int32), None))
                continue
            seen = tables.group_step(step, g)
            attn = self.spec.groups[g]
            assert isinstance(attn, AttentionSpec)
            meta_g = self.backend.build_metadata(seen, self._layer(attn, self.spec.num_blocks))
            groups.append(GroupStep(mx.array(seen.slot_mapping), meta_g))
        states = None
        if self.states is not None:
            self.states.tables = tables  # the state group's entries, read by the plan
            states = self.states.plan(step)
        return ForwardContext(mx.array(step.positions), self.backend, self.kv, groups, states)

    def forward(self, hidden: mx.array, meta: StepMeta) -> mx.array:
        """`[T, hidden]` in -> `[T, hidden]` out through this slice's layers (lazy; the caller evaluates)."""
        with forward_context(self.context(meta)):
            return run_layers(self.model, hidden)

    def pools(self) -> list[mx.array]:
        states = self.states.pool.all_arrays() if self.states is not None else []
        return [a for layer in self.kv for a in layer.arrays()] + states


def run_layers(model: PagedModel, hidden: mx.array) -> mx.array:
    """The slice's decoder layers on the packed axis; paged attention ignores mask and cache."""
    h = hidden[None]
    for layer in model.backbone.layers:
        h = layer(h, None, None)
    return h[0]
