"""Per-architecture config fields read from GGUF metadata, beyond the common ones (gguf_config.py).

Where llama.cpp hard-codes a model fact instead of storing it (gemma3's window pattern and 27B query
scale, qwen3moe's normalised top-k), the same value is used here; llama-3 rope parameters are recovered
from the stored factors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from metalserve.loader.errors import ModelLoadError
from metalserve.loader.gguf_metadata import get, require, to_python

# GGUF architecture -> (mlx-lm model_type, HF architecture name).
MODEL_TYPES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
# The `{arch}.rope.scaling.type` values each mlx-lm class honours (qwen3_moe's uses plain RoPE).
ROPE_SCALING_KINDS: dict[str, tuple[str, ...]] = {
    "llama": ("linear", "yarn"),
    "qwen2": ("linear", "yarn"),
    "qwen3": ("linear", "yarn"),
    "qwen3moe": (),
    "gemma3": ("linear",),
    "phi3": ("linear",),
}
# The rope factor tensors each architecture's config takes (gguf_weights.ROPE_FACTOR_TENSORS).
FACTOR_TENSORS = {"llama": ("rope_freqs.weight",), "phi3": ("rope_factors_long.weight", "rope_factors_short.weight")}
_LLAMA3_BOUNDS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_GEMMA3_DEFAULT_PATTERN = 6  # llama.cpp: every sixth layer is global
_GEMMA3_27B_LAYERS = 62  # llama.cpp scales the 27B's queries by hidden / heads instead of head_dim

Extras = Callable[[dict[str, Any], str, dict[str, Any], set[str], dict[str, list[float]]], dict[str, Any]]


def _llama3_factors(scaling: dict[str, Any], dims: int, base: float) -> np.ndarray:
    """The per-frequency factors mlx-lm's Llama3RoPE applies for `scaling` (llama.cpp stores these)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelens = 2 * np.pi * base ** (np.arange(0, dims, 2) / dims)
    smooth = (old / wavelens - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelens > old / low, factor, 1.0)
    return np.where((wavelens > old / high) & (wavelens < old / low), medium, out)


def _llama(
    metadata: dict[str, Any], arch: str, config: dict[str, Any], names: set[str], factors: dict[str, list[float]]
) -> dict[str, Any]:
    """llama-3.1-style rope: the file stores only the resulting factors; llama 3.1 to 3.3 all use these
    smoothing bounds, so they are checked against the factors rather than assumed."""
    stored = factors.get("rope_freqs.weight")
    if stored is None:
        return {}
    scaling = {"type": "llama3", "factor": max(stored), **_LLAMA3_BOUNDS}
    dims = int(get(metadata, f"{arch}.rope.dimension_count", config["head_dim"]))
    if len(stored) != dims // 2 or not np.allclose(
        _llama3_factors(scaling, dims, config["rope_theta"]), stored, rtol=1e-4
    ):
        raise ModelLoadError(
            "The GGUF's rope frequency factors (rope_freqs) are not llama-3's with factor "
            f"{scaling['factor']} and bounds {_LLAMA3_BOUNDS}; this rope scaling is not supported."
        )
    return {"rope_scaling": scaling}


def _plain(
    metadata: dict[str, Any], arch: str, config: dict[str, Any], names: set[str], factors: dict[str, list[float]]
) -> dict[str, Any]:
    return {}


def _qwen3moe(
    metadata: dict[str, Any], arch: str, config: dict[str, Any], names: set[str], factors: dict[str, list[float]]
) -> dict[str, Any]:
    expert_ffn = int(require(metadata, f"{arch}.expert_feed_forward_length"))
    return {
        "num_experts": int(require(metadata, f"{arch}.expert_count")),
        "num_experts_per_tok": int(require(metadata, f"{arch}.expert_used_count")),
        "moe_intermediate_size": expert_ffn,
        "intermediate_size": config["intermediate_size"] or expert_ffn,
        "decoder_sparse_step": 1,  # llama.cpp's qwen3moe has experts in every layer
        "mlp_only_layers": [],
        "norm_topk_prob": bool(get(metadata, f"{arch}.expert_weights_norm", True)),
    }


def _window_pattern(value: Any, layers: int) -> int:
    """gemma3's sliding-window period: stored as an int, as per-layer flags (True = sliding), or absent."""
    value = to_python(value)  # mx.load hands arrays as mx.array
    if value is None:
        return _GEMMA3_DEFAULT_PATTERN
    if isinstance(value, list):
        period = next((i + 1 for i, sliding in enumerate(value) if not sliding), len(value) + 1)
        if any(bool(s) != ((i + 1) % period != 0) for i, s in enumerate(value)) or len(value) != layers:
            raise ModelLoadError(f"The gemma3 GGUF's sliding window layers {value} are not periodic.")
        return period
    return int(value)


def _gemma3(
    metadata: dict[str, Any], arch: str, config: dict[str, Any], names: set[str], factors: dict[str, list[float]]
) -> dict[str, Any]:
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == _GEMMA3_27B_LAYERS else head_dim
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")
    return {
        "sliding_window": int(require(metadata, f"{arch}.attention.sliding_window")),
        "sliding_window_pattern": _window_pattern(pattern, layers),
        "rope_local_base_freq": float(get(metadata, f"{arch}.rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": float(scalar),
        "rms_norm_eps": float(get(metadata, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
    }


def _phi3(
    metadata: dict[str, Any], arch: str, config: dict[str, Any], names: set[str], factors: dict[str, list[float]]
) -> dict[str, Any]:
    head_dim = config["hidden_size"] // config["num_attention_heads"]  # mlx-lm's phi3 derives it so
    rotary = int(get(metadata, f"{arch}.rope.dimension_count", head_dim))
    original = int(get(metadata, f"{arch}.rope.scaling.original_context_length", config["max_position_embeddings"]))
    out: dict[str, Any] = {"partial_rotary_factor": rotary / head_dim, "original_max_position_embeddings": original}
    long, short = factors.get("rope_factors_long.weight"), factors.get("rope_factors_short.weight")
    if long is not None:
        if config["rope_scaling"] is not None:
            raise ModelLoadError("The phi3 GGUF has both rope factor tensors and a rope scaling type.")
        out["rope_scaling"] = {"type": "longrope", "long_factor": long, "short_factor": short or long}
    return out


ARCH_EXTRAS: dict[str, Extras] = {
    "llama": _llama,
    "qwen2": _plain,
    "qwen3": _plain,
    "qwen3moe": _qwen3moe,
    "gemma3": _gemma3,
    "phi3": _phi3,
}
