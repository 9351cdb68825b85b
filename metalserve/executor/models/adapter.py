"""Thin adapters over mlx-lm models: swap in paged attention, and compute logits for chosen rows only."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.executor.models.compute import MlxCompute, ModelCompute
from metalserve.executor.models.mla import PagedMLA, is_mla_attention
from metalserve.executor.models.paged_attention import PagedAttention

if TYPE_CHECKING:
    from metalserve.loader import LoadedModel
    from metalserve.platform import Platform

# Families whose attention we know how to take over (mistral loads as llama in mlx-lm).
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3",
    "deepseek_v2",  # MLA: models/mla.py
    "deepseek_v3",  # MLA
    "glm4_moe_lite",  # MLA
)  # fmt: skip
ALL_MLX = MlxCompute()  # stateless: one serves every model


class PagedModel:
    """An mlx-lm causal LM whose attention layers read and write the paged KV pools."""

    def __init__(self, model: nn.Module, model_type: str, compute: ModelCompute = ALL_MLX) -> None:
        """`compute`: how the rest of the model runs (models/compute.py, executor/host/); all MLX by default."""
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        self.model = model
        self.backbone = model.model
        args = model.args
        window = getattr(args, "sliding_window", None)
        for i, layer in enumerate(self.backbone.layers):
            if isinstance(layer.self_attn, (PagedAttention, PagedMLA)):
                raise ValueError("this model already has paged attention installed")
            if is_mla_attention(layer.self_attn):  # latent pages (models/mla.py)
                layer.self_attn = PagedMLA(layer.self_attn, i)
                continue
            uses_window = getattr(layer, "use_sliding", False)
            layer.self_attn = PagedAttention(layer.self_attn, i, window if uses_window else None)
        self.tied = bool(getattr(args, "tie_word_embeddings", False)) or not hasattr(model, "lm_head")
        self.compute = compute
        compute.install(self)
        # Materialise the fused projections now, on this thread's stream, before any forward runs.
        mx.eval(model.parameters())

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, platform: Platform) -> PagedModel:
        """The loaded model with the compute strategy the Platform calls for."""
        from metalserve.executor.host import choose_compute

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
        if self.tied:
            return self.backbone.embed_tokens.as_linear(hidden)
        return self.model.lm_head(hidden)

    def __call__(self, token_ids: np.ndarray, logits_indices: np.ndarray) -> mx.array:
        """Forward the packed tokens `[T]`; project only the rows `logits_indices` to the vocabulary."""
        return self.compute.forward(self, np.asarray(token_ids), np.asarray(logits_indices))
