"""Thin adapters over mlx-lm models: swap in paged attention, and compute logits for chosen rows only."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.executor.models.compute import MlxCompute, ModelCompute
from metalserve.executor.models.hybrid import install_hybrid
from metalserve.executor.models.hybrid_families import HYBRID_MODEL_TYPES
from metalserve.executor.models.paged_attention import PagedAttention
from metalserve.executor.state_cache import StateLayout

if TYPE_CHECKING:
    from metalserve.loader import LoadedModel
    from metalserve.platform import Platform

# Families whose attention we know how to take over (mistral loads as llama in mlx-lm).
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3",
    # Hybrids with recurrent-state layers (models/hybrid.py):
    "qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe", "nemotron_h", "granitemoehybrid",
)  # fmt: skip
ALL_MLX = MlxCompute()  # stateless: one serves every model


class PagedModel:
    """An mlx-lm causal LM whose attention layers read and write the paged KV pools."""

    def __init__(self, model: nn.Module, model_type: str, compute: ModelCompute = ALL_MLX) -> None:
        """`compute`: how the rest of the model runs (models/compute.py, executor/host/); all MLX by default."""
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        self.model = model
        self.state_layout: StateLayout | None = None  # the recurrent layers' states, for hybrid models
        self.logits_divisor = 1.0
        if model_type in HYBRID_MODEL_TYPES:
            self._install_hybrid(model, model_type)
        else:
            self._install_attention(model)
        self.compute = compute
        compute.install(self)
        # Materialise the fused projections now, on this thread's stream, before any forward runs.
        mx.eval(model.parameters())

    def _install_attention(self, model: nn.Module) -> None:
        self.backbone = model.model
        args = model.args
        window = getattr(args, "sliding_window", None)
        for i, layer in enumerate(self.backbone.layers):
            if isinstance(layer.self_attn, PagedAttention):
                raise ValueError("this model already has paged attention installed")
            uses_window = getattr(layer, "use_sliding", False)
            layer.self_attn = PagedAttention(layer.self_attn, i, window if uses_window else None)
        self.tied = bool(getattr(args, "tie_word_embeddings", False)) or not hasattr(model, "lm_head")
        self.embed = self.backbone.embed_tokens
        self.lm_head = None if self.tied else model.lm_head

    def _install_hybrid(self, model: nn.Module, model_type: str) -> None:
        parts = install_hybrid(model, model_type)
        self.backbone, self.embed, self.lm_head = parts.backbone, parts.embed, parts.lm_head
        self.tied = parts.lm_head is None
        self.state_layout = parts.state_layout
        self.logits_divisor = parts.logits_divisor

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, platform: Platform) -> PagedModel:
        """The loaded model with the compute strategy the Platform calls for."""
        from metalserve.executor.host import choose_compute

        if loaded.model_type in HYBRID_MODEL_TYPES:  # the host path knows dense llama-family layers only
            return cls(loaded.model, loaded.model_type)
        return cls(loaded.model, loaded.model_type, choose_compute(platform, loaded.codes))

    def host_bytes(self) -> int:
        """Bytes of weights held outside MLX (the stored codes), which MLX's memory counters do not see."""
        return self.compute.host_bytes()

    def host_description(self) -> str:
        """What runs on the host instead of MLX, for the start-up log."""
        return self.compute.description()

    def mlx_hidden_states(self, token_ids: mx.array) -> mx.array:
        """token_ids: [T] -> final-normed hidden states [T, hidden], through mlx-lm's modules."""
        return self.backbone(token_ids[None])[0]

    def mlx_logits(self, hidden: mx.array) -> mx.array:
        logits = self.embed.as_linear(hidden) if self.lm_head is None else self.lm_head(hidden)
        return logits if self.logits_divisor == 1.0 else logits / self.logits_divisor

    def __call__(self, token_ids: np.ndarray, logits_indices: np.ndarray) -> mx.array:
        """Forward the packed tokens `[T]`; project only the rows `logits_indices` to the vocabulary."""
        return self.compute.forward(self, np.asarray(token_ids), np.asarray(logits_indices))
