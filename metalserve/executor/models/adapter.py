"""Thin adapters over mlx-lm models: swap in paged attention, and compute logits for chosen rows only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.executor.context import current_context
from metalserve.executor.models.attention_traits import all_traits
from metalserve.executor.models.compute import MlxCompute
from metalserve.executor.models.families import ModelFamily, model_family
from metalserve.executor.models.hybrid import install_hybrid
from metalserve.executor.models.kv_layout import KVLayout
from metalserve.executor.models.mla import PagedMLA, is_mla_attention
from metalserve.executor.models.mrope_attention import PagedMRoPEAttention
from metalserve.executor.models.paged_attention import PagedAttention
from metalserve.executor.state_cache import StateLayout
from metalserve.kvcache.specs import KVCacheSpec, PageDtype, RecurrentState

if TYPE_CHECKING:
    pass

ALL_MLX = MlxCompute()  # stateless: one serves every model


class ModelCompute(Protocol):
    """How a `PagedModel` computes outside attention: all in MLX (models/compute.py) or partly on the host
    (executor/host/), chosen once from the Platform (`metalserve.executor.host.choose_compute`)."""

    def install(self, model: PagedModel) -> None:
        """Swap in this strategy's modules and materialise what it needs (once, at construction)."""

    def forward(self, model: PagedModel, token_ids: np.ndarray, logits_indices: np.ndarray) -> mx.array:
        """Packed token ids `[T]` -> the logits `[S, vocab]` of the rows `logits_indices`."""

    def host_job(
        self, model: PagedModel, token_ids: np.ndarray, logits_indices: np.ndarray
    ) -> Callable[[], np.ndarray] | None:
        """The forward as a call that touches NumPy only (None: part of it runs in MLX)."""

    def description(self) -> str:
        """What runs on the host instead of MLX, for the start-up log."""

    def host_bytes(self) -> int:
        """Bytes of weights held outside MLX, which MLX's memory counters do not see."""


class PagedModel:
    """An mlx-lm causal LM whose attention layers read and write the paged KV pools."""

    def __init__(
        self,
        model: nn.Module,
        model_type: str,
        compute: ModelCompute = ALL_MLX,
        *,
        kv_layout: KVLayout | None = None,
        state_groups: tuple[RecurrentState, ...] | None = None,
    ) -> None:
        """`compute`: how the rest of the model runs (models/compute.py, executor/host/); all MLX by default.
        `kv_layout`, `state_groups`: a pipeline stage's (distributed/stage.py): the whole model's groups
        over this slice's tensors, and its state groups, whose slot bytes become this slice's; None: the
        model's own."""
        self.family = model_family(model_type)  # UnsupportedModelType (a ValueError) for other types
        self.model = model
        self.state_layout: StateLayout | None = None  # the recurrent layers' states, for hybrid models
        self.state_groups: tuple[RecurrentState, ...] = ()  # their layer group (kvcache/specs.py)
        if self.family.hybrid:
            self._install_hybrid(model, model_type, kv_layout, state_groups)
        else:
            self._install_attention(model, self.family, kv_layout)
        self.compute = compute
        compute.install(self)
        # Materialise the fused projections now, on this thread's stream, before any forward runs.
        mx.eval(model.parameters())

    def _install_attention(self, model: nn.Module, family: ModelFamily, layout: KVLayout | None) -> None:
        self.backbone = model.model
        layers = self.backbone.layers
        if any(isinstance(getattr(layer, "self_attn", None), PagedAttention | PagedMLA) for layer in layers):
            raise ValueError("this model already has paged attention installed")
        # Read before the swap (ours keep mlx-lm's module as `inner`).
        self.kv_layout = family.kv_layout(model) if layout is None else layout
        if family.mla:  # latent pages: one tensor per layer, group 0 (models/mla.py)
            for i, layer in enumerate(layers):
                if not is_mla_attention(layer.self_attn):
                    raise ValueError(f"layer {i} mixes MLA with another attention: not supported")
                layer.self_attn = PagedMLA(layer.self_attn, i)
        else:
            paged = PagedMRoPEAttention if family.mrope else PagedAttention
            for traits in all_traits(model):
                i = traits.layer
                tensor, group = self.kv_layout.layer_tensor[i], self.kv_layout.layer_group[i]
                layers[i].self_attn = paged(layers[i].self_attn, traits, tensor, group)
        self.tied = "lm_head" not in model  # mlx-lm builds (or keeps) no lm_head for tied embeddings
        self.embed = self.backbone.embed_tokens
        self.lm_head = None if self.tied else model.lm_head
        # What mlx-lm's Model.__call__ does to the logits after the head (granite, gemma2/4).
        self.logits_scaling = getattr(model, "logits_scaling", None)
        self.final_softcap = getattr(model, "final_logit_softcapping", None)
        self.logit_scale = getattr(model.args, "logit_scale", None)  # cohere2 multiplies the logits

    def _install_hybrid(
        self, model: nn.Module, model_type: str, layout: KVLayout | None, groups: tuple[RecurrentState, ...] | None
    ) -> None:
        if layout is None:
            layout = self.family.kv_layout(model)
        parts = install_hybrid(model, model_type)
        self.backbone, self.embed, self.lm_head = parts.backbone, parts.embed, parts.lm_head
        self.tied = parts.lm_head is None
        self.kv_layout = layout
        self.state_layout = parts.state_layout
        if groups is None:
            self.state_groups = self.family.state_groups(model, parts.state_layout)
        else:
            self.state_groups = tuple(replace(g, state_bytes=parts.state_layout.slot_bytes) for g in groups)
        self.logits_scaling = parts.logits_divisor if parts.logits_divisor != 1.0 else None
        self.final_softcap = self.logit_scale = None

    def get_kv_cache_spec(self, page: PageDtype, block_size: int, num_blocks: int = 0) -> KVCacheSpec:
        """The cache spec of every layer group (vLLM's get_kv_cache_spec): attention pages stored as
        `page` says, recurrent states as they are."""
        return self.kv_layout.kv_cache_spec(page, block_size, self.state_groups, num_blocks)

    def host_bytes(self) -> int:
        """Bytes of weights held outside MLX (the stored codes), which MLX's memory counters do not see."""
        return self.compute.host_bytes()

    def host_description(self) -> str:
        """What runs on the host instead of MLX, for the start-up log."""
        return self.compute.description()

    def mlx_hidden_states(self, token_ids: mx.array) -> mx.array:
        """token_ids: [T] -> final-normed hidden states [T, hidden], through mlx-lm's modules.

        A step with images (a vision-language model's) has the vision tower's embeddings replace its
        image placeholder tokens' before the first layer."""
        images = current_context().images if self.family.vision else None
        if images is None:
            return self.backbone(token_ids[None])[0]
        embeds = self.embed(token_ids)
        embeds[images.rows] = images.features
        return self.backbone(token_ids[None], inputs_embeds=embeds[None])[0]

    def mlx_logits(self, hidden: mx.array) -> mx.array:
        logits = self.embed.as_linear(hidden) if self.lm_head is None else self.lm_head(hidden)
        if self.logits_scaling:
            logits = logits / self.logits_scaling
        if self.logit_scale:
            logits = logits * self.logit_scale
        if self.final_softcap:
            logits = mx.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def host_job(self, token_ids: np.ndarray, logits_indices: np.ndarray) -> Callable[[], np.ndarray] | None:
        """The step's whole forward as a NumPy-only call (the host decoder), to run on another thread;
        None where any of it runs in MLX. Call it inside the step's forward context."""
        return self.compute.host_job(self, np.asarray(token_ids), np.asarray(logits_indices))

    def __call__(self, token_ids: np.ndarray, logits_indices: np.ndarray) -> mx.array:
        """Forward the packed tokens `[T]`; project only the rows `logits_indices` to the vocabulary."""
        return self.compute.forward(self, np.asarray(token_ids), np.asarray(logits_indices))
