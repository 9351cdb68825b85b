"""Tiny random-weight hybrid models built with mlx-lm's own classes, and their LoadedModel."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from metalserve.loader import LoadedModel

HYBRID_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe", "nemotron_h", "granitemoehybrid")
VOCAB = 256
_BASE: dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024
)
_GATED_DELTA: dict[str, Any] = dict(
    num_hidden_layers=4,
    intermediate_size=128,
    head_dim=16,
    rms_norm_eps=1e-6,
    full_attention_interval=2,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
)
CONFIGS: dict[str, dict[str, Any]] = {
    # MoE on every second layer, partial rotary (a quarter of the head), gated attention output.
    "qwen3_next": dict(
        **_GATED_DELTA,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
        mlp_only_layers=[],
        shared_expert_intermediate_size=64,
        moe_intermediate_size=64,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
    ),
    "qwen3_5": dict(
        **_GATED_DELTA,
        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    "qwen3_5_moe": dict(
        **_GATED_DELTA,
        num_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=64,
        moe_intermediate_size=64,
        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    "lfm2": dict(
        num_hidden_layers=4,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_ff_dim=128,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        rope_theta=10000.0,
    ),
    # The first layer's MLP dense, the others MoE.
    "lfm2_moe": dict(
        num_hidden_layers=4,
        norm_eps=1e-5,
        conv_bias=True,
        conv_L_cache=3,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        use_expert_bias=True,
        num_dense_layers=1,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        rope_theta=10000.0,
    ),
    "nemotron_h": dict(
        intermediate_size=128,
        attention_bias=False,
        mamba_num_heads=4,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=16,
        conv_kernel=4,
        n_groups=2,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        hybrid_override_pattern=["M", "-", "*", "M", "-"],
        head_dim=16,
    ),
    # Granite 4.0-H: Mamba2 and NoPE attention, MoE with a shared MLP, µP multipliers, scaled logits.
    "granitemoehybrid": dict(
        intermediate_size=128,
        num_hidden_layers=4,
        attention_bias=False,
        embedding_multiplier=2.0,
        attention_multiplier=0.2,
        logits_scaling=4.0,
        residual_multiplier=0.5,
        rms_norm_eps=1e-5,
        layer_types=["mamba", "attention", "mamba", "mamba"],
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_proj_bias=False,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_n_groups=2,
        mamba_conv_bias=True,
        position_embedding_type="nope",
        tie_word_embeddings=False,
    ),
}
_KEEP = ("A_log", "dt_bias", "D")  # the recurrences' own parameters keep mlx-lm's initialisation


def tiny_hybrid(model_type: str, seed: int = 0, bits: int | None = None) -> nn.Module:
    """`bits`: affine-quantize every linear and embedding (group 32), as mlx-community ships models."""
    mx.random.seed(seed)
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    model = module.Model(module.ModelArgs.from_dict({"model_type": model_type, **_BASE, **CONFIGS[model_type]}))
    # Larger-than-default weights make the logits peaky, so greedy ties are unlikely.
    params = nn.utils.tree_flatten(model.parameters())
    model.update(nn.utils.tree_unflatten([(k, v if k.endswith(_KEEP) else v * 3.0) for k, v in params]))
    if bits is not None:
        nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


def tiny_hybrid_loaded(model_type: str, seed: int = 0, bits: int | None = None) -> LoadedModel:
    return LoadedModel(
        model=tiny_hybrid(model_type, seed, bits),
        tokenizer=None,
        model_type=model_type,  # type: ignore[arg-type]
        config={},
        max_model_len=1024,
        eos_token_ids=frozenset(),
        chat_template=None,
        source="tiny",
        weights_desc="fp32",
        blas_desc="-",
    )
