"""Which of mlx-lm's RoPE classes run per token with an array of positions as `offset`.

The packed batch applies RoPE to `[T, H, 1, D]` with `offset=positions` `[T]`: each token is its own
batch row at its own position. Every class below ends in `mx.fast.rope(..., offset=offset)` with no
other use of the offset, which MLX broadcasts per batch row. DynamicNTK scaling derives its base from
the sequence length (`offset + L`), which has no per-token meaning here, so a model using it is refused.
"""

from __future__ import annotations

import mlx.nn as nn
from mlx_lm.models import rope_utils

PER_TOKEN_ROPES: tuple[str, ...] = (
    "RoPE",  # nn.RoPE: default, linear and mrope scaling; partial rotary through `dims`
    "Llama3RoPE",
    "YarnRoPE",
    "SuScaledRoPE",  # longrope / su (phi3)
    "ProportionalRoPE",  # gemma4's partial rotary
    "NoPE",  # smollm3's layers without positions
)


def check_rope(rope: nn.Module | None, layer: int) -> None:
    """Raise unless layer `layer`'s RoPE takes per-token positions (see the module docstring)."""
    if rope is None:
        return
    if isinstance(rope, rope_utils.DynamicNTKScalingRoPE):
        raise ValueError(
            f"layer {layer} uses dynamic NTK RoPE scaling, whose base depends on the sequence length: "
            "metalserve runs RoPE per token and does not support it"
        )
    if type(rope).__name__ not in PER_TOKEN_ROPES:
        raise ValueError(f"layer {layer} uses RoPE class {type(rope).__name__}, unknown to metalserve")
