"""GGUF metadata -> mlx-lm config: the facts llama.cpp stores, and the ones it hard-codes."""

from __future__ import annotations

import math
from typing import Any

import pytest

from metalserve.loader import ModelLoadError
from metalserve.loader.gguf_config import config_from_gguf


def meta(arch: str, **extra: Any) -> dict[str, Any]:
    base = {
        "general.architecture": arch,
        f"{arch}.embedding_length": 5376,
        f"{arch}.block_count": 4,
        f"{arch}.attention.head_count": 32,
        f"{arch}.attention.head_count_kv": 16,
        f"{arch}.attention.key_length": 128,
        f"{arch}.feed_forward_length": 64,
        f"{arch}.context_length": 512,
        "tokenizer.ggml.tokens": ["a", "b"],
    }
    return {**base, **{k.replace("ARCH", arch): v for k, v in extra.items()}}


def test_gemma3_gets_llama_cpps_default_window_pattern_and_query_scale() -> None:
    config = config_from_gguf(meta("gemma3", **{"ARCH.attention.sliding_window": 1024}), set())
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == 1024
    assert config["sliding_window_pattern"] == 6 and config["query_pre_attn_scalar"] == 128
    assert config["rope_local_base_freq"] == 10000.0 and config["tie_word_embeddings"] is True
    # The 27B (62 layers) scales queries by hidden / heads, as llama.cpp does.
    big = config_from_gguf(meta("gemma3", **{"ARCH.attention.sliding_window": 1024, "ARCH.block_count": 62}), set())
    assert big["query_pre_attn_scalar"] == 5376 // 32


def test_gemma3_window_flags_must_be_periodic() -> None:
    flags = {"ARCH.attention.sliding_window": 8, "ARCH.attention.sliding_window_pattern": [True, False, False, True]}
    with pytest.raises(ModelLoadError, match="not periodic"):
        config_from_gguf(meta("gemma3", **flags), set())
    flags["ARCH.attention.sliding_window_pattern"] = [True, False, True, False]
    assert config_from_gguf(meta("gemma3", **flags), set())["sliding_window_pattern"] == 2


def test_rope_scaling_maps_where_the_class_honours_it_and_is_refused_where_not() -> None:
    yarn = {
        "ARCH.rope.scaling.type": "yarn",
        "ARCH.rope.scaling.factor": 4.0,
        "ARCH.rope.scaling.original_context_length": 32768,
    }
    config = config_from_gguf(meta("qwen3", **yarn), {"output.weight"})
    assert config["rope_scaling"] == {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert config["tie_word_embeddings"] is False
    moe = {**yarn, "ARCH.expert_count": 8, "ARCH.expert_used_count": 2, "ARCH.expert_feed_forward_length": 32}
    with pytest.raises(ModelLoadError, match="rope scaling 'yarn'.*supported: none"):
        config_from_gguf(meta("qwen3moe", **moe), set())


def test_qwen3moe_and_phi3_fields() -> None:
    moe = {"ARCH.expert_count": 8, "ARCH.expert_used_count": 2, "ARCH.expert_feed_forward_length": 32}
    config = config_from_gguf(meta("qwen3moe", **moe), set())
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (8, 2, 32)
    assert config["norm_topk_prob"] is True and config["mlp_only_layers"] == []
    factors = {"rope_factors_long.weight": [1.0, 2.0], "rope_factors_short.weight": [1.0, 1.5]}
    phi = config_from_gguf(meta("phi3", **{"ARCH.rope.dimension_count": 126}), set(), factors)
    assert phi["partial_rotary_factor"] == 126 / 168 and phi["original_max_position_embeddings"] == 512
    assert phi["rope_scaling"] == {"type": "longrope", "long_factor": [1.0, 2.0], "short_factor": [1.0, 1.5]}


def test_an_unsupported_architecture_names_the_supported_ones() -> None:
    with pytest.raises(ModelLoadError, match="'mamba' is not supported.*llama, qwen2, qwen3, qwen3moe, gemma3, phi3"):
        config_from_gguf(meta("mamba"), set())


def converter_rope_freqs(factor: float, dims: int, base: float) -> list[float]:
    """llama.cpp's converter's rope_freqs for llama 3.1 (low 1, high 4, original context 8192)."""
    out = []
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / dims))
        if wavelen < 8192 / 4:
            out.append(1.0)
        elif wavelen > 8192 / 1:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def test_llama3_rope_parameters_are_recovered_from_the_stored_factors() -> None:
    m = meta("llama", **{"ARCH.rope.freq_base": 500000.0})
    factors = {"rope_freqs.weight": converter_rope_freqs(8.0, 128, 500000.0)}
    config = config_from_gguf(m, set(), factors)
    assert config["rope_scaling"] == {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    factors["rope_freqs.weight"][20] *= 1.5  # not llama-3's curve: refused, not approximated
    with pytest.raises(ModelLoadError, match="not llama-3's"):
        config_from_gguf(m, set(), factors)
    with pytest.raises(ModelLoadError, match="carries 'rope_freqs.weight'"):
        config_from_gguf(meta("qwen2"), set(), {"rope_freqs.weight": [1.0]})
