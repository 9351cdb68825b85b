"""Tiny random-weight MLA models (mlx-lm's own classes) and the golden check against mlx-lm's generation.

A small copy of the shared golden harness (tests/models/golden.py, part A) for the MLA models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import deepseek_v2, deepseek_v3, glm4_moe_lite

from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.loader import LoadedModel
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from tests.models.golden import reference

# Three layers: one dense MLP, then two MoE layers (sigmoid gate with grouped top-k, shared expert);
# DeepSeek's YaRN RoPE (its own mscale, and mscale_all_dim changing the attention scale); a LoRA'd query.
TINY_MLA: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    routed_scaling_factor=1.5,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=16,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    moe_layer_freq=1,
    first_k_dense_replace=1,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling={
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
)
MODULES = {"deepseek_v2": deepseek_v2, "deepseek_v3": deepseek_v3, "glm4_moe_lite": glm4_moe_lite}


def tiny_mla(model_type: str = "deepseek_v3", seed: int = 0, **overrides: Any) -> nn.Module:
    mx.random.seed(seed)
    module = MODULES[model_type]
    cfg = {**TINY_MLA, "model_type": model_type, **overrides}
    if model_type == "glm4_moe_lite":
        cfg.setdefault("partial_rotary_factor", 1.0)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    # Larger-than-default weights make the logits peaky, so greedy ties are unlikely; the routers start
    # at zero in mlx-lm, so they get random weights (else every expert ties).
    model.update(nn.utils.tree_map(lambda p: p * 3.0, model.parameters()))
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.weight = mx.random.normal(gate.weight.shape) * 0.5
            if "e_score_correction_bias" in gate:
                gate.e_score_correction_bias = mx.random.normal(gate.e_score_correction_bias.shape) * 0.1
    mx.eval(model.parameters())
    return model


def loaded_of(model: nn.Module, model_type: str) -> LoadedModel:
    """The model as the loader hands it on (its KV shape is the family's to read off it)."""
    return LoadedModel(
        model=model,
        tokenizer=None,
        model_type=model_type,
        config={},
        max_model_len=1024,  # type: ignore[arg-type]
        eos_token_ids=frozenset(),
        chat_template=None,
        source="tiny",
        weights_desc="fp32",
        blas_desc="-",
    )


@dataclass
class Greedy:
    tokens: list[int]
    logprobs: list[float]
    cached: int = 0  # prompt tokens the engine found in its prefix cache


def mlx_lm_greedy(model: nn.Module, prompt: list[int], n: int) -> Greedy:
    """mlx-lm's own generation: its model call with its contiguous cache, greedy, with chosen logprobs."""
    ref = reference(model, prompt, n)
    return Greedy(ref.tokens, ref.logprobs)


def prompts_of(lengths: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def engine_greedy(core: EngineCore, prompts: list[list[int]], n: int, tag: str = "r") -> list[Greedy]:
    """Run the prompts together through the real engine; each one's tokens and chosen logprobs."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"{tag}{i}", p, params))
    got = {f"{tag}{i}": Greedy([], []) for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for out in core.step():
            got[out.request_id].tokens += out.new_token_ids
            got[out.request_id].logprobs += [lp.logprob for lp in out.new_logprobs or []]
            got[out.request_id].cached = max(got[out.request_id].cached, out.num_cached_tokens)
    return [got[f"{tag}{i}"] for i in range(len(prompts))]


def make_core(model: nn.Module, model_type: str, *, budget: int = 512, backend: str = "auto") -> EngineCore:
    config = EngineConfig(
        kv_cache_memory=1 << 22, max_num_batched_tokens=budget, block_size=16, attention_backend=backend
    )
    return build_engine_core(config, loaded_of(model, model_type))


def assert_matches(got: Greedy, want: Greedy) -> None:
    assert got.tokens == want.tokens
    assert len(got.logprobs) == len(want.logprobs)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-2)
