"""`--hf-overrides`: the user's edits to the model's HF-style config (as vLLM's flag), applied before the
model is built, and the context length a RoPE scaling in them stretches the model to."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from metalserve.loader.errors import ModelLoadError

# RoPE scalings that stretch the trained context by `factor` (mlx-lm's rope_utils.initialize_rope).
# "dynamic" is refused later (executor/models/rope.py): its base depends on the sequence length.
STRETCHING_ROPE_TYPES = ("linear", "dynamic", "yarn")


def apply_hf_overrides(config: dict[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of `config` with `overrides` merged in: nested objects merge key by key, the rest replace."""
    if not overrides:
        return config
    merged = copy.deepcopy(config)
    _merge(merged, overrides)
    return merged


def _merge(into: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(dict(value)) if isinstance(value, Mapping) else value


def rope_type(config: Mapping[str, Any]) -> str | None:
    scaling = config.get("rope_scaling")
    if not isinstance(scaling, Mapping):
        return None
    return str(scaling.get("type") or scaling.get("rope_type") or "default")


def scaled_context(config: Mapping[str, Any], trained: int) -> int | None:
    """The context a stretching RoPE scaling covers: its original length (yarn names it) times `factor`;
    None without one."""
    kind = rope_type(config)
    if kind not in STRETCHING_ROPE_TYPES:
        return None
    scaling = config["rope_scaling"]
    factor = scaling.get("factor")
    if not isinstance(factor, int | float) or factor <= 0:
        raise ModelLoadError(f"--hf-overrides: rope_scaling {kind} needs a positive number `factor`, got {factor!r}")
    original = scaling.get("original_max_position_embeddings") or trained
    return int(int(original) * float(factor))
