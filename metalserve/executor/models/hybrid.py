"""Taking over a hybrid mlx-lm model: paged attention layers and recurrent mixers on the packed axis."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from metalserve.executor.models.hybrid_attention import HybridAttention
from metalserve.executor.models.hybrid_families import FAMILIES, backbone_of, embedding_of, logits_divisor, mixers_of
from metalserve.executor.models.state_mixer import StateMixer, probe_layout
from metalserve.executor.state_cache import StateLayout


@dataclass(frozen=True)
class HybridParts:
    backbone: nn.Module
    embed: nn.Module
    lm_head: nn.Module | None  # None: the embedding is the vocabulary projection
    state_layout: StateLayout
    attention_layers: tuple[int, ...]  # layer indices, in KV-cache order
    state_layers: tuple[int, ...]  # layer indices, in state-pool order
    logits_divisor: float = 1.0  # mlx-lm's model divides its logits by this after the head


def _lm_head(model: Any, model_type: str) -> nn.Module | None:
    lm = FAMILIES[model_type].language_model(model)
    args = getattr(lm, "args", None)
    if getattr(args, "tie_word_embeddings", False) or not hasattr(lm, "lm_head"):
        return None
    return lm.lm_head


def activation_dtype(model: nn.Module, model_type: str) -> mx.Dtype:
    """The dtype of the embedding's output, which every mixer's input and conv state take."""
    embed = embedding_of(model, model_type)
    return embed.scales.dtype if isinstance(embed, nn.QuantizedEmbedding) else embed.weight.dtype


def state_layout_of(model: nn.Module, model_type: str) -> StateLayout:
    """The per-request state of every recurrent layer, probed through mlx-lm's own modules."""
    embed = embedding_of(model, model_type)
    hidden = int(embed.weight.shape[1]) if not isinstance(embed, nn.QuantizedEmbedding) else int(embed.dims)
    modules = [m.module for m in mixers_of(model, model_type) if m.kind == "state"]
    inner = [m.inner if isinstance(m, StateMixer) else m for m in modules]
    return probe_layout(inner, hidden, activation_dtype(model, model_type))


def install_hybrid(model: nn.Module, model_type: str) -> HybridParts:
    """Swap every mixer of `model` for its paged twin; the state layout is probed before the swap."""
    mixers = mixers_of(model, model_type)
    for m in mixers:
        if isinstance(m.module, HybridAttention | StateMixer):
            raise ValueError("this model already has paged layers installed")
    layout = state_layout_of(model, model_type)
    states = [m for m in mixers if m.kind == "state"]
    attns = [m for m in mixers if m.kind == "attention"]
    for i, m in enumerate(attns):
        setattr(m.owner, m.attr, HybridAttention(m.module, i))
    for i, m in enumerate(states):
        setattr(m.owner, m.attr, StateMixer(m.module, i, layout.cache_size))
    return HybridParts(
        backbone=backbone_of(model, model_type),
        embed=embedding_of(model, model_type),
        lm_head=_lm_head(model, model_type),
        state_layout=layout,
        attention_layers=tuple(m.layer_idx for m in attns),
        state_layers=tuple(m.layer_idx for m in states),
        logits_divisor=logits_divisor(model, model_type),
    )
