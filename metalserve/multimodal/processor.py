"""A vision-language model's image processing: pixels for its tower, placeholder tokens in the prompt.

The chat template puts one image token where each image goes (templates take `{"type": "image"}`
parts); `process` expands each to the image's number of placeholder tokens and returns the images as
`MultiModalInput`s. Qwen2-VL and Qwen2.5-VL use mlx-vlm's NumPy port of their image processor: an image
is smart-resized to multiples of 28 pixels (14-pixel patches merged 2x2), one placeholder per merged
patch. It runs in the API's tokenizer thread and makes no MLX arrays.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from metalserve.multimodal.images import DecodedImage, ImageError
from metalserve.multimodal.inputs import MultiModalInput

# Qwen2-VL's preprocessor_config.json keys the processor takes (the rest are HF bookkeeping).
_QWEN_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "image_mean", "image_std")


class ImageProcessor(Protocol):
    """What the API asks of a vision-language model's processor (in the tokenizer thread)."""

    image_token_id: int

    def process(
        self, prompt: Sequence[int], images: Sequence[DecodedImage]
    ) -> tuple[list[int], list[MultiModalInput]]: ...

    def settings(self) -> dict[str, Any]:
        """What decides the pixels an image becomes (the KV disk tier keys stored blocks on it: an image's
        content hash is taken before processing)."""
        ...


class QwenVLImageProcessor:
    """Qwen2-VL / Qwen2.5-VL images -> pixel patches, their grid, and placeholder tokens."""

    def __init__(self, image_token_id: int, merge_size: int, options: dict[str, Any]) -> None:
        from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor

        self.image_token_id = image_token_id
        self.merge_size = merge_size
        self._options = {"patch_size": 14, **options, "merge_size": merge_size}
        self._processor = Qwen3VLImageProcessor(**self._options)

    def settings(self) -> dict[str, Any]:
        return {"kind": "qwen_vl", **self._options}

    @classmethod
    def from_config(
        cls, config: dict[str, Any], directory: Path | None = None, tokenizer: Any = None
    ) -> QwenVLImageProcessor:
        """From the model's config.json (and the directory's preprocessor_config.json, when there is one).
        The tokenizer is not needed: Qwen's image tokens replace the template's one token by token."""
        vision = config.get("vision_config") or {}
        options: dict[str, Any] = {
            "patch_size": vision.get("patch_size", 14),
            "temporal_patch_size": vision.get("temporal_patch_size", 2),
        }
        pre = directory / "preprocessor_config.json" if directory is not None else None
        if pre is not None and pre.is_file():
            raw = json.loads(pre.read_text())
            size = raw.get("size") or {}
            raw.setdefault("min_pixels", size.get("shortest_edge"))
            raw.setdefault("max_pixels", size.get("longest_edge"))
            options.update({k: raw[k] for k in _QWEN_KEYS if raw.get(k) is not None})
        options.pop("merge_size", None)
        return cls(int(config["image_token_id"]), int(vision.get("spatial_merge_size", 2)), options)

    def encode_image(self, image: DecodedImage) -> tuple[np.ndarray, tuple[int, int, int]]:
        """One image's patches `[patches, C * T * P * P]` (float32) and its patch grid (t, h, w)."""
        out = self._processor(images=[image.image])
        grid = tuple(int(x) for x in np.asarray(out["image_grid_thw"])[0])
        return np.asarray(out["pixel_values"], dtype=np.float32), (grid[0], grid[1], grid[2])

    def process(self, prompt: Sequence[int], images: Sequence[DecodedImage]) -> tuple[list[int], list[MultiModalInput]]:
        """Expand the prompt's image tokens (one per image, in order) to each image's placeholders."""
        slots = image_slots(prompt, self.image_token_id, len(images))
        tokens: list[int] = []
        inputs: list[MultiModalInput] = []
        previous = 0
        for slot, image in zip(slots, images, strict=True):
            pixels, grid = self.encode_image(image)
            length = grid[0] * grid[1] * grid[2] // self.merge_size**2
            tokens += prompt[previous:slot]
            data = {"pixel_values": pixels, "grid_thw": grid}
            inputs.append(MultiModalInput(image.content_hash, len(tokens), length, data))
            tokens += [self.image_token_id] * length
            previous = slot + 1
        tokens += prompt[previous:]
        return tokens, inputs


def image_slots(prompt: Sequence[int], token_id: int, num_images: int) -> list[int]:
    """Where the chat template put one `token_id` per image; ImageError when the counts differ."""
    slots = [i for i, token in enumerate(prompt) if token == token_id]
    if len(slots) != num_images:
        raise ImageError(f"the chat template placed {len(slots)} image placeholders for {num_images} images")
    return slots


class Gemma3ImageProcessor:
    """Gemma 3 (SigLIP): every image resized to the tower's square `image_size`, scaled to [0, 1] and
    normalised; `mm_tokens_per_image` placeholders each (the tower's patches average-pooled).

    The chat template puts one `<start_of_image>` token per image. HF's processor (and mlx-vlm's) replaces
    it in the text with "\n\n", `<start_of_image>`, the placeholders, `<end_of_image>`, "\n\n" and then
    tokenizes: the blank lines merge with the newlines beside them (Gemma has a token per run of newlines).
    With the tokenizer, the prompt's text is tokenized the same way here; the placeholders and
    `<end_of_image>` follow each `<start_of_image>`. Pan-and-scan crops are not made."""

    def __init__(
        self,
        image_token_id: int,
        boi_token_id: int,
        eoi_token_id: int,
        size: int,
        tokens: int,
        mean: Sequence[float],
        std: Sequence[float],
        tokenizer: Any = None,
    ) -> None:
        self.image_token_id = image_token_id
        self.tokenizer = tokenizer  # None: the blank lines HF adds around an image are left out
        self.boi_token_id, self.eoi_token_id = boi_token_id, eoi_token_id
        self.size, self.tokens_per_image = size, tokens
        self.mean = np.asarray(mean, dtype=np.float32)[:, None, None]
        self.std = np.asarray(std, dtype=np.float32)[:, None, None]

    def settings(self) -> dict[str, Any]:
        return {
            "kind": "gemma3",
            "size": self.size,
            "tokens": self.tokens_per_image,
            "mean": self.mean.ravel().tolist(),
            "std": self.std.ravel().tolist(),
        }

    @classmethod
    def from_config(
        cls, config: dict[str, Any], directory: Path | None = None, tokenizer: Any = None
    ) -> Gemma3ImageProcessor:
        pre: dict[str, Any] = {}
        path = directory / "preprocessor_config.json" if directory is not None else None
        if path is not None and path.is_file():
            pre = json.loads(path.read_text())
        text, vision = config.get("text_config") or {}, config.get("vision_config") or {}
        return cls(
            int(config.get("image_token_index", 262144)),
            int(config.get("boi_token_index", 255999)),
            int(config.get("eoi_token_index", 256000)),
            int(vision.get("image_size", 224)),
            int(text.get("mm_tokens_per_image", 256)),
            pre.get("image_mean", [0.5] * 3),
            pre.get("image_std", [0.5] * 3),
            tokenizer,
        )

    def pixels(self, image: DecodedImage) -> np.ndarray:
        """`[1, 3, size, size]` float32, as the tower takes them (channels first)."""
        from PIL import Image

        resized = image.image.convert("RGB").resize((self.size, self.size), Image.Resampling.BILINEAR)
        chw = np.asarray(resized, dtype=np.float32).transpose(2, 0, 1) / 255.0
        return ((chw - self.mean) / self.std)[None].astype(np.float32)

    def process(self, prompt: Sequence[int], images: Sequence[DecodedImage]) -> tuple[list[int], list[MultiModalInput]]:
        slots = image_slots(prompt, self.boi_token_id, len(images))
        spaced = self._with_blank_lines(prompt, slots)
        if spaced is not None:
            prompt = spaced
            slots = image_slots(prompt, self.boi_token_id, len(images))
        tokens: list[int] = []
        inputs: list[MultiModalInput] = []
        previous = 0
        for slot, image in zip(slots, images, strict=True):
            tokens += prompt[previous : slot + 1]
            data = {"pixel_values": self.pixels(image)}
            inputs.append(MultiModalInput(image.content_hash, len(tokens), self.tokens_per_image, data))
            tokens += [self.image_token_id] * self.tokens_per_image + [self.eoi_token_id]
            previous = slot + 1
        tokens += prompt[previous:]
        return tokens, inputs

    def _with_blank_lines(self, prompt: Sequence[int], slots: Sequence[int]) -> list[int] | None:
        """The prompt re-tokenized with "\n\n" on both sides of every `<start_of_image>`, as HF's processor
        tokenizes it; None without a tokenizer, or when the prompt's text does not tokenize back to the
        prompt itself (then the blank lines are left out rather than guessed)."""
        tok = self.tokenizer
        if tok is None:
            return None
        bounds = [-1, *slots, len(prompt)]
        texts = [
            tok.decode(list(prompt[a + 1 : b]), skip_special_tokens=False, clean_up_tokenization_spaces=False)
            for a, b in zip(bounds, bounds[1:], strict=False)
        ]
        boi = tok.convert_ids_to_tokens(self.boi_token_id)
        if list(tok.encode(boi.join(texts), add_special_tokens=False)) != list(prompt):
            return None
        return list(tok.encode(f"\n\n{boi}\n\n".join(texts), add_special_tokens=False))


_PROCESSORS: dict[str, Callable[[dict[str, Any], Path | None, Any], ImageProcessor]] = {
    "qwen2_vl": QwenVLImageProcessor.from_config,
    "qwen2_5_vl": QwenVLImageProcessor.from_config,
    "gemma3": Gemma3ImageProcessor.from_config,
}


def image_processor_for(config: dict[str, Any], directory: Path | None = None, tokenizer: Any = None) -> ImageProcessor:
    """The image processor of a vision-language model's config; ImageError for a family without one.
    `tokenizer`: the model's, for a family whose processor works on the text (Gemma 3)."""
    model_type = str(config.get("model_type"))
    make = _PROCESSORS.get(model_type)
    if make is None:
        supported = ", ".join(_PROCESSORS)
        raise ImageError(f"images are not supported for model type {model_type!r} (supported: {supported})")
    return make(config, directory, tokenizer)
