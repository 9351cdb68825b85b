"""Build an mlx-lm model object from an HF-style config and a dict of MLX-layout weights."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import infer_quant_config

from metalserve.loader.errors import ModelLoadError
from metalserve.loader.loaded import SUPPORTED_MODEL_TYPES

# mlx-lm implements mistral with its llama module.
_MLX_LM_MODULES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Built for GGUF files (gguf_arch_config.py); the engine's adapter decides whether it serves them.
_MLX_LM_MODULES.update({"qwen3_moe": "qwen3_moe", "gemma3_text": "gemma3_text", "phi3": "phi3"})


def model_classes(model_type: str) -> tuple[type[nn.Module], Any]:
    if model_type not in _MLX_LM_MODULES:
        raise ModelLoadError(
            f"Model type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})."
        )
    module = importlib.import_module(f"mlx_lm.models.{_MLX_LM_MODULES[model_type]}")
    return module.Model, module.ModelArgs


def _quantize_where_packed(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Turn each layer whose weights come with `.scales` into its quantized twin, bits/group per layer."""

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return dict(infer_quant_config(path, module, weights))

    nn.quantize(model, class_predicate=predicate)


def build_model(config: dict[str, Any], weights: dict[str, mx.array]) -> nn.Module:
    """Instantiate the mlx-lm class for `config`, quantize the packed layers and load every weight."""
    model_cls, args_cls = model_classes(config["model_type"])
    try:
        model = model_cls(args_cls.from_dict(config))  # type: ignore[call-arg]
    except (TypeError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"The model config is incomplete or invalid: {exc}") from exc
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    _quantize_where_packed(model, weights)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"The weights do not match the model config: {exc}") from exc
    return model
