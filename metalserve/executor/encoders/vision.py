"""An mlx-vlm model's vision tower and projector, run on the engine thread one image at a time."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from metalserve.multimodal.inputs import MultiModalInput


class VisionTower:
    """Qwen2-VL / Qwen2.5-VL: patches and their grid -> one embedding per placeholder token (the tower
    ends in the patch merger, which projects to the language model's width)."""

    def __init__(self, vlm: nn.Module, dtype: mx.Dtype) -> None:
        """`vlm`: the mlx-vlm model (its `vision_tower`); `dtype`: the language model's activations'."""
        self.tower: Any = vlm.vision_tower
        self.dtype = dtype

    def __call__(self, mm: MultiModalInput) -> mx.array:
        pixels = mx.array(mm.data["pixel_values"]).astype(self.tower.patch_embed.proj.weight.dtype)
        grid = mx.array([list(mm.data["grid_thw"])], dtype=mx.int32)
        return self.tower(pixels, grid, output_hidden_states=False).astype(self.dtype)
