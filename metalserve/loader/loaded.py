"""What a successful load hands to the rest of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # keep `import metalserve.loader` free of MLX (the BLAS must load first)
    import mlx.core as mx
    import mlx.nn as nn
    from transformers import PreTrainedTokenizerBase

    from metalserve.kernels.affine_codes import AffineCodes


@dataclass
class LoadedModel:
    """An mlx-lm model with its tokenizer, chat template, EOS ids and the facts the KV cache needs."""

    model: nn.Module  # an mlx-lm model: .model.embed_tokens, .model.layers[i].self_attn, ...
    tokenizer: PreTrainedTokenizerBase
    model_type: str  # one of executor/models/adapter.py: SUPPORTED_MODEL_TYPES
    config: dict[str, Any]  # HF-style config
    max_model_len: int
    eos_token_ids: frozenset[int]
    chat_template: str | None
    source: str  # what was loaded: a path, a repo id, or "embedded default: <path>"
    weights_desc: str  # e.g. "fp32 (dequantized from Q4_1, 540 MB)"
    blas_desc: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: mx.Dtype  # the activations' dtype (and so the KV cache's)
    # The stored codes of dequantized layers by module path, kept on MLX's CPU backend for the host path.
    codes: dict[str, AffineCodes] = field(default_factory=dict)
    # MLA's latent layout: the KV "head" (num_kv_heads 1, head_dim kv_lora + rope) is K alone, V its
    # first value_dim (kv_lora) channels; None: K and V of head_dim each.
    value_dim: int | None = None
    # The context a RoPE scaling from --hf-overrides stretches max_model_len (the trained one) to; None: none.
    rope_scaled_len: int | None = None

    @property
    def kv_planes(self) -> int:
        """Arrays of head_dim that one token keeps per layer and KV head: K and V, or the latent alone."""
        return 1 if self.value_dim is not None else 2

    def describe(self) -> str:
        """One line for the start-up log: which model, which weights path, which BLAS."""
        return f"model {self.source}: {self.model_type}, weights {self.weights_desc}, BLAS {self.blas_desc}"


@dataclass
class RawModel:
    """A model's parts before an mlx-lm object is built: config, MLX-layout weights and tokenizer."""

    config: dict[str, Any]
    weights: dict[str, mx.array]
    tokenizer: PreTrainedTokenizerBase
    chat_template: str | None
    stored_as: str  # e.g. "Q4_1" or "4-bit affine (group 64)" or "bfloat16"
