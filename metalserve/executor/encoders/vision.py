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


class Gemma3VisionTower:
    """Gemma 3: SigLIP's last hidden states, pooled and projected to the language model's width by the
    multimodal projector, then divided by sqrt(hidden) as mlx-vlm does (the language model multiplies
    every input embedding by sqrt of its own width; mlx-vlm divides by the top-level config's)."""

    def __init__(self, vlm: nn.Module, dtype: mx.Dtype) -> None:
        self.tower: Any = vlm.vision_tower
        self.projector: Any = vlm.multi_modal_projector
        self.scale = float(vlm.config.hidden_size) ** 0.5
        self.dtype = dtype

    def __call__(self, mm: MultiModalInput) -> mx.array:
        pixels = mx.array(mm.data["pixel_values"]).transpose(0, 2, 3, 1).astype(self.dtype)
        hidden, _, _ = self.tower(pixels, output_hidden_states=True)
        return (self.projector(hidden)[0] / self.scale).astype(self.dtype)


def vision_tower_for(vlm: nn.Module, dtype: mx.Dtype) -> VisionTower | Gemma3VisionTower:
    """The tower that turns one image into its placeholder embeddings, read off the model: Gemma 3 has a
    separate multimodal projector, Qwen's towers end in their patch merger."""
    return Gemma3VisionTower(vlm, dtype) if "multi_modal_projector" in vlm else VisionTower(vlm, dtype)
