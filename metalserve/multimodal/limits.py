"""The per-request image limits (ServerSettings' flags; multimodal/images.py applies them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageLimits:
    """Per request: how many images, how many pixels each, how many decoded bytes in all."""

    max_images: int = 8
    max_pixels: int = 16_777_216  # 4096 x 4096
    max_bytes: int = 20 * 1024 * 1024
