"""Images from a request body: data URLs and base64 decoded, checked against the limits, opened safely.

The server fetches nothing: an http(s) URL is refused. Pillow opens only the formats the APIs name
(PNG, JPEG, GIF, WebP); the pixel count is checked from the header before any pixel is decoded (a
decompression bomb is refused unread), and a truncated or corrupt file fails on load. Every failure is
an `ImageError` whose message says what was wrong; the API turns it into a 400 in its own shape.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from dataclasses import dataclass

from PIL import Image

from metalserve.multimodal.limits import ImageLimits

FORMATS = ("PNG", "JPEG", "GIF", "WEBP")
MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")


class ImageError(ValueError):
    """An image the server cannot take; the message is for the client."""


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB
    content_hash: bytes  # sha256 over the size and the decoded pixels (vLLM's multimodal hash)


def split_data_url(url: str) -> tuple[str, str]:
    """`data:<media type>;base64,<data>` -> (media type, base64 text); ImageError for anything else."""
    if url.startswith(("http://", "https://")):
        raise ImageError(
            "image URLs are not fetched: this server reaches no network; send the image inline as a data URL "
            "(data:image/png;base64,...)"
        )
    if not url.startswith("data:"):
        raise ImageError("an image URL must be a data URL (data:image/png;base64,...)")
    header, sep, data = url[5:].partition(",")
    media_type, _, encoding = header.partition(";")
    if not sep or encoding != "base64":
        raise ImageError("an image data URL must be base64-encoded (data:image/png;base64,...)")
    return media_type, data


_URL_SAFE = str.maketrans("-_", "+/")


def decode_base64(data: str, media_type: str | None) -> bytes:
    if media_type is not None and media_type not in MEDIA_TYPES:
        raise ImageError(f"image media type {media_type!r} is not supported (supported: {', '.join(MEDIA_TYPES)})")
    # MIME writers wrap base64 at 76 columns and URL-safe encoders use "-_" and drop the padding: all
    # still one image. Anything else outside the alphabet stays an error.
    text = "".join(data.split()).translate(_URL_SAFE)
    text += "=" * (-len(text) % 4)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data is not valid base64") from None


def open_image(data: bytes, limits: ImageLimits) -> DecodedImage:
    """Decode one image's file bytes into RGB pixels, within the pixel limit."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width * height > limits.max_image_pixels:
                raise ImageError(
                    f"the image has {width}x{height} = {width * height} pixels, more than the limit of "
                    f"{limits.max_image_pixels} (--max-image-pixels)"
                )
            if width < 1 or height < 1:
                raise ImageError("the image has no pixels")
            image.load()  # a truncated or corrupt file fails here, not in the engine
            rgb = image.convert("RGB")
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # Pillow's own check, on open
        raise ImageError(
            f"the image has more pixels than the limit of {limits.max_image_pixels} (--max-image-pixels)"
        ) from None
    except Image.UnidentifiedImageError:
        raise ImageError("could not process image: not a PNG, JPEG, GIF or WebP image Pillow can read") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ImageError(f"could not process image: the file is corrupt or truncated ({exc})") from None
    digest = hashlib.sha256()
    digest.update(f"{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return DecodedImage(rgb, digest.digest())


class ImageBudget:
    """Counts one request's images and decoded bytes against the limits as they are read."""

    def __init__(self, limits: ImageLimits) -> None:
        self.limits = limits
        self.count = 0
        self.bytes = 0

    def take(self, data: bytes) -> DecodedImage:
        self.count += 1
        if self.count > self.limits.max_images_per_request:
            raise ImageError(
                f"a request may hold at most {self.limits.max_images_per_request} images (--max-images-per-request)"
            )
        self.bytes += len(data)
        if self.bytes > self.limits.max_image_bytes_per_request:
            raise ImageError(
                f"the request's images take more than {self.limits.max_image_bytes_per_request} bytes decoded "
                "(--max-image-bytes-per-request)"
            )
        return open_image(data, self.limits)
