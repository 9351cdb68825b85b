"""Tiny configs of every covered architecture, built with mlx-lm's own `Model(ModelArgs(...))` classes.

Hidden 64, 2-4 layers, vocab 256; windowed models get a 16-token window so a 300-token prompt crosses
it many times. Each config switches on the family's quirk: MoE routing, q/k norms per head or over the
projection, partial rotary and longrope (phi3), sinks and alternating windows (gpt-oss), KV shared
across layers with k used as v and wider full-attention heads (gemma4), scale and logit multipliers
(granite), the attention soft-cap (gemma2).
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

VOCAB = 256
WINDOW = 16
BASE: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
    rope_theta=10000.0,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

ARCHS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, **MOE),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    "gemma3_text": dict(
        num_hidden_layers=4,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        sliding_window_pattern=2,
        rope_local_base_freq=10000.0,
        rope_theta=1e6,
    ),
    "gemma4_text": dict(
        num_hidden_layers=4,
        head_dim=16,
        global_head_dim=32,
        sliding_window=WINDOW,
        sliding_window_pattern=2,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        final_logit_softcapping=30.0,
    ),
    "gpt_oss": dict(
        num_hidden_layers=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        head_dim=16,
        sliding_window=WINDOW,
    ),
    "phi3": dict(
        partial_rotary_factor=0.5,
        original_max_position_embeddings=256,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [1.0, 2.0, 4.0, 8.0]},
    ),
    "olmo2": dict(tie_word_embeddings=False),
    "granite": dict(
        logits_scaling=2.0,
        attention_multiplier=0.2,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_bias=False,
        mlp_bias=False,
    ),
    # Cheap extras: the generic adapter fits them as they are.
    "qwen2_moe": dict(shared_expert_intermediate_size=64, **MOE),
    "olmo3": dict(num_hidden_layers=4, sliding_window=WINDOW),  # 3 sliding : 1 full -> four groups of one
    "granitemoe": dict(
        logits_scaling=2.0,
        attention_multiplier=0.2,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_bias=False,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=5.0, final_logit_softcapping=30.0),
    "smollm3": dict(num_hidden_layers=4),  # layer 3 has no RoPE
    "glm4": dict(head_dim=16, attention_bias=True, partial_rotary_factor=0.5),
    "starcoder2": dict(norm_epsilon=1e-5),
    "seed_oss": dict(head_dim=16),
    "internlm3": dict(head_dim=16, qkv_bias=False, bias=False),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "ernie4_5": dict(head_dim=16, use_bias=False),
    "exaone4": dict(  # "LLLG": three local layers with RoPE, one global without
        head_dim=16,
        num_hidden_layers=4,
        sliding_window=WINDOW,
        sliding_window_pattern="LLLG",
        rope_scaling=None,
    ),
    "cohere2": dict(  # 3 sliding layers with RoPE : 1 full layer without; logits scaled; parallel blocks
        head_dim=16,
        num_hidden_layers=4,
        sliding_window=WINDOW,
        sliding_window_pattern=4,
        logit_scale=0.5,
        layer_norm_eps=1e-5,
    ),
    "ministral3": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=WINDOW,
        rope_parameters={"rope_theta": 10000.0, "llama_4_scaling_beta": 0.5, "original_max_position_embeddings": 64},
    ),  # Llama 4's query scaling by position, windows on alternate layers
    # RoPE scalings the families above do not use, each on a llama (key: variant name, model_type inside).
    "llama+llama3_rope": dict(
        model_type="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama+yarn_rope": dict(
        model_type="llama",
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.0,
        },
    ),
}


def config_of(arch: str, **overrides: Any) -> dict[str, Any]:
    return {**BASE, "model_type": arch, **ARCHS[arch], **overrides}


def build(arch: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A random-weight tiny model of `arch` (a model type, or a variant naming its own), weights scaled
    so greedy choices are clear. Its `model_type` attribute is the type the engine is told."""
    mx.random.seed(seed)
    config = config_of(arch, **overrides)
    model_type = config["model_type"]
    module = importlib.import_module(f"mlx_lm.models.{'llama' if model_type == 'mistral' else model_type}")
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: p * 2.0, model.parameters()))
    for layer in model.model.layers:  # mlx-lm starts sinks at zero: give them values that matter
        if "sinks" in layer.self_attn:
            layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape)
    mx.eval(model.parameters())
    return model
