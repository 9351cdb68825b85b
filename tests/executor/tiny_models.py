"""Small random-weight models and a greedy stand-in sampler for runner tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3

from metalserve.outputs import TokenLogprob

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=97,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def tiny_model(model_type: str = "llama", seed: int = 0, **overrides: object) -> nn.Module:
    mx.random.seed(seed)
    module = {"llama": llama, "mistral": llama, "qwen2": qwen2, "qwen3": qwen3}[model_type]
    cfg = {**TINY, "model_type": model_type, **overrides}
    if model_type == "qwen3":
        cfg.setdefault("head_dim", 16)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    # Larger-than-default weights make the logits peaky, so greedy ties are unlikely.
    model.update(nn.utils.tree_map(lambda p: p * 3.0, model.parameters()))
    mx.eval(model.parameters())
    return model


@dataclass
class GreedyResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def greedy_sampler(logits: mx.array, requests: Sequence[object]) -> GreedyResult:
    return GreedyResult(mx.argmax(logits, axis=-1).tolist(), [None] * len(requests))
