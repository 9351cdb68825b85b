"""Build an mlx-lm model object from an HF-style config and a dict of MLX-layout weights."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import infer_quant_config

from metalserve.loader.errors import ModelLoadError

# mlx-lm implements mistral with its llama module; every other type is its own module.
_MLX_LM_MODULES = {"mistral": "llama"}


def model_classes(model_type: str) -> tuple[type[nn.Module], Any]:
    """mlx-lm's classes for `model_type` (whether metalserve serves the type is the caller's check:
    load_model's `check_model_type`)."""
    name = _MLX_LM_MODULES.get(model_type, model_type)
    try:
        module = importlib.import_module(f"mlx_lm.models.{name}")
    except ModuleNotFoundError as exc:
        raise ModelLoadError(f"mlx-lm has no model class for model type {model_type!r}.") from exc
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
