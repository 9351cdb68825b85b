"""Thin adapters over mlx-lm models: swap in paged attention, and compute logits for chosen rows only."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from metalserve.executor.models.paged_attention import PagedAttention

# Families whose attention we know how to take over (mistral loads as llama in mlx-lm).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class PagedModel:
    """An mlx-lm causal LM whose attention layers read and write the paged KV pools."""

    def __init__(self, model: nn.Module, model_type: str) -> None:
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        self.model = model
        self.backbone = model.model
        args = model.args
        window = getattr(args, "sliding_window", None)
        for i, layer in enumerate(self.backbone.layers):
            if isinstance(layer.self_attn, PagedAttention):
                raise ValueError("this model already has paged attention installed")
            uses_window = getattr(layer, "use_sliding", False)
            layer.self_attn = PagedAttention(layer.self_attn, i, window if uses_window else None)
        # Materialise the fused projections now, on this thread's stream, before any forward runs.
        mx.eval(model.parameters())
        self.tied = bool(getattr(args, "tie_word_embeddings", False)) or not hasattr(model, "lm_head")

    def hidden_states(self, token_ids: mx.array) -> mx.array:
        """token_ids: [T] -> final-normed hidden states [T, hidden]."""
        return self.backbone(token_ids[None])[0]

    def logits(self, hidden: mx.array) -> mx.array:
        if self.tied:
            return self.backbone.embed_tokens.as_linear(hidden)
        return self.model.lm_head(hidden)

    def __call__(self, token_ids: mx.array, logits_indices: mx.array) -> mx.array:
        """Forward the packed tokens; project only the rows that sample to the vocabulary."""
        hidden = self.hidden_states(token_ids)
        return self.logits(hidden[logits_indices])
