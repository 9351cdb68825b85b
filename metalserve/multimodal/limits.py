"""The per-request image limits (ServerSettings' image flags; multimodal/images.py applies them): a
request above one gets a 400."""

from __future__ import annotations

from dataclasses import dataclass

from metalserve.flags import flag


@dataclass(frozen=True)
class ImageLimits:
    """Per request: how many images, how many pixels each, how many decoded bytes in all."""

    max_images_per_request: int = flag(8, "most images one request may hold")
    max_image_pixels: int = flag(16_777_216, "most pixels one image may have (width x height; checked before decoding)")
    max_image_bytes_per_request: int = flag(
        20 * 1024 * 1024, "most bytes a request's images may take, decoded from base64"
    )

    def __post_init__(self) -> None:
        if min(self.max_images_per_request, self.max_image_pixels, self.max_image_bytes_per_request) < 1:
            raise ValueError(
                "--max-images-per-request, --max-image-pixels and --max-image-bytes-per-request must be >= 1"
            )
