"""The KV layout of a model: its attention layer groups and the pool tensors the groups share.

vLLM's layout: the layers are split into groups of one kind (full attention, or one sliding window)
and equal size; layer j of every group shares pool tensor j, indexed by the group's own block ids.
Blocks come from one shared pool and a block id belongs to one group at a time, so a block costs the
K/V of one group's layers (`max layers per group`), not of all layers: a sliding group returns the
blocks behind its window to the pool, and every group can reuse them. A model of one kind keeps one
group of all layers (one tensor per layer).

Layers that read another layer's K/V (gemma4's shared KV) own no tensor: they use their source's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.nn as nn

from metalserve.executor.models.attention_traits import AttentionTraits, all_traits
from metalserve.kvcache.specs import (
    AttentionSpec,
    FullAttention,
    KVCacheDtype,
    KVCacheSpec,
    MLALatent,
    PageDtype,
    RecurrentState,
    SlidingWindow,
)


@dataclass(frozen=True)
class KVLayout:
    """Which layer uses which group and pool tensor; the specs carry shapes (their page dtype is set by
    `kv_cache_spec`, which is what everything that sizes or allocates pages reads)."""

    groups: tuple[AttentionSpec, ...]  # group 0 is full attention where the model has such layers
    tensors: tuple[AttentionSpec, ...]  # each pool tensor's shape
    layer_tensor: tuple[int, ...]  # per layer: the tensor it reads and writes (-1: not an attention layer)
    layer_group: tuple[int, ...]  # per layer: the group whose block table it uses (-1: none)

    @property
    def value_dim(self) -> int | None:
        """MLA's latent pages: K alone, V its first value_dim channels; None otherwise."""
        first = self.groups[0] if self.groups else None
        return first.value_dim if isinstance(first, MLALatent) else None

    def kv_cache_spec(
        self, page: PageDtype, block_size: int, states: tuple[RecurrentState, ...] = (), num_blocks: int = 0
    ) -> KVCacheSpec:
        """The model's cache spec: every attention page as `page` says (kinds that cannot be quantized
        keep `page.dtype`), followed by the recurrent-state groups."""
        base = replace(page, storage=KVCacheDtype.AUTO)

        def paged(spec: AttentionSpec) -> AttentionSpec:
            return replace(spec, page=base).with_storage(page.storage)

        groups = tuple(paged(g) for g in self.groups)
        return KVCacheSpec(groups + states, tuple(paged(t) for t in self.tensors), block_size, num_blocks)  # type: ignore[arg-type]


def _kinds(owners: list[AttentionTraits]) -> list[list[AttentionTraits]]:
    """Layers by kind: full attention first, then each window in order of first use."""
    kinds: dict[int | None, list[AttentionTraits]] = {}
    for t in sorted(owners, key=lambda t: t.window is not None):
        kinds.setdefault(t.window, []).append(t)
    return list(kinds.values())


def _spec(window: int | None, layers: list[AttentionTraits]) -> AttentionSpec:
    ids = tuple(t.layer for t in layers)
    heads, dim = layers[0].n_kv_heads, layers[0].head_dim
    if window is None:
        return FullAttention(layers=ids, num_kv_heads=heads, head_dim=dim)
    return SlidingWindow(window, layers=ids, num_kv_heads=heads, head_dim=dim)


def layout_of(traits: list[AttentionTraits], num_layers: int | None = None) -> KVLayout:
    """`traits`: the attention layers'; `num_layers`: all layers (default: as many as there are traits)."""
    owners = [t for t in traits if t.kv_source == t.layer]
    num_layers = len(traits) if num_layers is None else num_layers
    if not owners:  # a slice without attention layers (a pipeline stage's test case): nothing to keep
        return KVLayout((), (), (-1,) * num_layers, (-1,) * num_layers)
    kinds = _kinds(owners)
    size = min(len(k) for k in kinds)  # vLLM's rule: the smallest kind sets the group size
    groups: list[list[AttentionTraits]] = [kind[i : i + size] for kind in kinds for i in range(0, len(kind), size)]
    tensor_of: dict[tuple[int, int, int], int] = {}
    layer_tensor, layer_group = [-1] * num_layers, [-1] * num_layers
    for g, members in enumerate(groups):
        if len({(t.n_kv_heads, t.head_dim) for t in members}) != 1:
            raise ValueError(f"layers {[t.layer for t in members]} share a window but not a KV shape")
        for j, t in enumerate(members):
            key = (j, t.n_kv_heads, t.head_dim)
            layer_tensor[t.layer] = tensor_of.setdefault(key, len(tensor_of))
            layer_group[t.layer] = g
    for t in traits:  # shared-KV layers read their source's tensor through its group's table
        if t.kv_source != t.layer:
            layer_tensor[t.layer] = layer_tensor[t.kv_source]
            layer_group[t.layer] = layer_group[t.kv_source]
    return KVLayout(
        groups=tuple(_spec(m[0].window, m) for m in groups),
        tensors=tuple(
            FullAttention(num_kv_heads=h, head_dim=d) for _, h, d in sorted(tensor_of, key=tensor_of.__getitem__)
        ),
        layer_tensor=tuple(layer_tensor),
        layer_group=tuple(layer_group),
    )


def model_kv_layout(model: nn.Module) -> KVLayout:
    """The layout of an mlx-lm model (or of one whose attention we took over)."""
    return layout_of(all_traits(model), len(model.model.layers))


def hybrid_kv_layout(model: nn.Module, model_type: str) -> KVLayout:
    """A hybrid model's attention layers: one full-attention group, one pool tensor per attention layer
    in layer order (models/hybrid_attention.py indexes them so); recurrent layers own no tensor."""
    from metalserve.executor.models.hybrid_families import attention_shape, backbone_of, mixers_of

    layers = [m.layer_idx for m in mixers_of(model, model_type) if m.kind == "attention"]
    _, heads, head_dim = attention_shape(model, model_type)
    num_layers = len(backbone_of(model, model_type).layers)
    layer_tensor, layer_group = [-1] * num_layers, [-1] * num_layers
    for j, i in enumerate(layers):
        layer_tensor[i], layer_group[i] = j, 0
    tensor = FullAttention(num_kv_heads=heads, head_dim=head_dim)
    return KVLayout(
        groups=(replace(tensor, layers=tuple(layers)),),
        tensors=(tensor,) * len(layers),
        layer_tensor=tuple(layer_tensor),
        layer_group=tuple(layer_group),
    )


def mla_kv_layout(model: nn.Module) -> KVLayout | None:
    """An MLA model's latent pages (models/mla.py): one full-attention group, one tensor per layer of
    one "KV head" of width kv_lora + rope; None for a model without MLA attention."""
    from metalserve.executor.models.mla import latent_kv_shape

    layers = model.model.layers
    shape = latent_kv_shape(layers[0].self_attn) if layers and "self_attn" in layers[0] else None
    if shape is None:
        return None
    width, value_dim = shape
    n = len(layers)
    tensor = MLALatent(num_kv_heads=1, head_dim=width, value_dim=value_dim)
    return KVLayout(
        groups=(replace(tensor, layers=tuple(range(n))),),
        tensors=(tensor,) * n,
        layer_tensor=tuple(range(n)),
        layer_group=(0,) * n,
    )


def stage_layout(full: KVLayout, layers: range) -> KVLayout:
    """A pipeline stage's view of the whole model's layout `full`: every layer group stays (the scheduler's
    one block table per group indexes them on every rank), but the pool tensors are the stage's own.

    The stage's layers are numbered from `layers.start`; layer j (in layer order) of a group on this stage
    takes the stage's tensor j of its shape, so groups share tensors under their own block ids as in
    `layout_of`, and a block costs what this stage's layers keep, not the whole model's."""
    start, n = layers.start, len(layers)
    tensor_of: dict[tuple[int, AttentionSpec], int] = {}
    layer_tensor, layer_group = [-1] * n, [-1] * n
    for g, group in enumerate(full.groups):
        for j, i in enumerate(i for i in group.layers if i in layers):
            key = (j, full.tensors[full.layer_tensor[i]])
            layer_tensor[i - start] = tensor_of.setdefault(key, len(tensor_of))
            layer_group[i - start] = g
    for i in layers:  # shared-KV layers (gemma4) read their source's tensor, which must be on this stage
        if full.layer_tensor[i] < 0 or layer_tensor[i - start] >= 0:
            continue
        group = full.groups[full.layer_group[i]]
        source = next(s for s in group.layers if full.layer_tensor[s] == full.layer_tensor[i])
        if source not in layers:
            raise ValueError(f"layer {i} reads the K/V of layer {source}, which is on another pipeline stage")
        layer_tensor[i - start], layer_group[i - start] = layer_tensor[source - start], layer_group[source - start]
    return KVLayout(
        groups=full.groups,
        tensors=tuple(spec for _, spec in sorted(tensor_of, key=tensor_of.__getitem__)),
        layer_tensor=tuple(layer_tensor),
        layer_group=tuple(layer_group),
    )
