"""Thin adapters over mlx-lm models: swap in paged attention, and compute logits for chosen rows only."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.executor.models.attention_traits import all_traits
from metalserve.executor.models.compute import MlxCompute, ModelCompute
from metalserve.executor.models.hybrid import install_hybrid
from metalserve.executor.models.hybrid_families import HYBRID_MODEL_TYPES
from metalserve.executor.models.kv_layout import hybrid_kv_layout, mla_kv_layout, model_kv_layout
from metalserve.executor.models.mla import PagedMLA, is_mla_attention
from metalserve.executor.models.paged_attention import PagedAttention
from metalserve.executor.state_cache import StateLayout

if TYPE_CHECKING:
    from metalserve.loader import LoadedModel
    from metalserve.platform import Platform

# Families whose attention we know how to take over (mistral loads as llama in mlx-lm). Each has a golden
# test in tests/models/ (tiny random weights, greedy tokens identical to mlx-lm's own generation).
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3",
    "qwen3_moe", "mixtral", "gemma3_text", "gemma4_text", "gpt_oss", "phi3", "olmo2", "granite",
    "qwen2_moe", "olmo3", "granitemoe", "gemma2", "smollm3", "glm4", "starcoder2", "ministral3",
    "seed_oss", "internlm3", "olmoe", "phimoe", "ernie4_5", "cohere2", "exaone4",
    # Hybrids with recurrent-state layers (models/hybrid.py):
    "qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe", "nemotron_h", "granitemoehybrid",
    # MLA, latent pages (models/mla.py):
    "deepseek_v2", "deepseek_v3", "glm4_moe_lite",
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
        layers = self.backbone.layers
        if any(isinstance(getattr(layer, "self_attn", None), PagedAttention | PagedMLA) for layer in layers):
            raise ValueError("this model already has paged attention installed")
        mla = mla_kv_layout(model)
        if mla is not None:  # latent pages: one tensor per layer, group 0 (models/mla.py)
            self.kv_layout = mla
            for i, layer in enumerate(layers):
                if not is_mla_attention(layer.self_attn):
                    raise ValueError(f"layer {i} mixes MLA with another attention: not supported")
                layer.self_attn = PagedMLA(layer.self_attn, i)
        else:
            self.kv_layout = model_kv_layout(model)
            for traits in all_traits(model):
                i = traits.layer
                tensor, group = self.kv_layout.layer_tensor[i], self.kv_layout.layer_group[i]
                layers[i].self_attn = PagedAttention(layers[i].self_attn, traits, tensor, group)
        self.tied = "lm_head" not in model  # mlx-lm builds (or keeps) no lm_head for tied embeddings
        self.embed = self.backbone.embed_tokens
        self.lm_head = None if self.tied else model.lm_head
        # What mlx-lm's Model.__call__ does to the logits after the head (granite, gemma2/4).
        self.logits_scaling = getattr(model, "logits_scaling", None)
        self.final_softcap = getattr(model, "final_logit_softcapping", None)
        self.logit_scale = getattr(model.args, "logit_scale", None)  # cohere2 multiplies the logits

    def _install_hybrid(self, model: nn.Module, model_type: str) -> None:
        parts = install_hybrid(model, model_type)
        self.backbone, self.embed, self.lm_head = parts.backbone, parts.embed, parts.lm_head
        self.tied = parts.lm_head is None
        self.kv_layout = hybrid_kv_layout(model, model_type)
        self.state_layout = parts.state_layout
        self.logits_scaling = parts.logits_divisor if parts.logits_divisor != 1.0 else None
        self.final_softcap = self.logit_scale = None

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, platform: Platform) -> PagedModel:
        """The loaded model with the compute strategy the Platform calls for."""
        from metalserve.executor.host import choose_compute

        return cls(loaded.model, loaded.model_type, choose_compute(platform, loaded.codes, loaded.model_type))

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
