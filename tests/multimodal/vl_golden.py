"""The vision golden harness: a tiny mlx-vlm model served by the real engine against mlx-vlm's own
greedy generation (`generate_step`, which runs the tower, merges the features and lays out M-RoPE)."""

from __future__ import annotations

import io
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from PIL import Image

from metalserve.engine.core import EngineCore
from metalserve.loader import LoadedModel
from metalserve.multimodal.images import ImageLimits, open_image
from metalserve.multimodal.inputs import MultiModalInput
from metalserve.multimodal.processor import QwenVLImageProcessor
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from tests.models.golden import engine, loaded_of
from tests.multimodal.tiny_vlm import IM_END, build, config, vl_tokenizer

NEW_TOKENS = 8


def png(seed: int, size: tuple[int, int] = (84, 56)) -> bytes:
    """A random RGB image (width, height) as PNG file bytes."""
    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def loaded_vlm(vlm: nn.Module, model_type: str) -> LoadedModel:
    """What the loader hands over for a vision-language model: the language model, the whole model, the
    processor, the tokenizer."""
    loaded = loaded_of(vlm.language_model, model_type)
    loaded.vision = vlm
    loaded.image_processor = QwenVLImageProcessor.from_config(config(model_type))
    loaded.tokenizer = vl_tokenizer()
    loaded.eos_token_ids = frozenset({IM_END})
    return loaded


def vl_engine(model_type: str, *, budget: int = 2048, **overrides: Any) -> EngineCore:
    """The real engine over a fresh copy of `build(model_type)` (the engine swaps its attention layers, so
    the reference keeps a model of its own with the same weights)."""
    vlm = build(model_type)
    return engine(vlm.language_model, model_type, budget=budget, loaded=loaded_vlm(vlm, model_type), **overrides)


def prompt(
    messages: list[dict[str, Any]], images: list[bytes], model_type: str
) -> tuple[list[int], list[MultiModalInput]]:
    """The chat template's tokens with each image's placeholders expanded, and the images."""
    tokens = vl_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(tokens, list):
        tokens = tokens["input_ids"]
    decoded = [open_image(data, ImageLimits()) for data in images]
    return QwenVLImageProcessor.from_config(config(model_type)).process(tokens, decoded)


def user(text: str, num_images: int = 1) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}


def reference(vlm: nn.Module, tokens: list[int], images: list[MultiModalInput], n: int = NEW_TOKENS) -> list[int]:
    """mlx-vlm's own greedy generation of `n` tokens."""
    from mlx_vlm.generate.ar import generate_step

    kwargs: dict[str, Any] = {}
    pixels = None
    if images:
        pixels = mx.array(np.concatenate([mm.data["pixel_values"] for mm in images]))
        kwargs["image_grid_thw"] = mx.array([list(mm.data["grid_thw"]) for mm in images])
    out = []
    for token, _ in generate_step(mx.array([tokens]), vlm, pixels, None, max_tokens=n, temperature=0.0, **kwargs):
        out.append(int(token))
    return out


def serve(
    core: EngineCore, batch: list[tuple[list[int], list[MultiModalInput]]], n: int = NEW_TOKENS, tag: str = "r"
) -> list[tuple[list[int], int]]:
    """Run the batch together (greedy, `n` tokens each): each request's tokens and cached prompt tokens."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    ids = [f"{tag}{i}" for i in range(len(batch))]
    for rid, (tokens, images) in zip(ids, batch, strict=True):
        core.add_request(Request(rid, list(tokens), params, mm_inputs=list(images)))
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    cached = dict.fromkeys(ids, 0)
    while core.has_unfinished_requests():
        for out in core.step():
            got[out.request_id] += out.new_token_ids
            cached[out.request_id] = max(cached[out.request_id], out.num_cached_tokens)
    return [(got[rid], cached[rid]) for rid in ids]


__all__ = ["build", "png", "prompt", "reference", "serve", "user", "vl_engine"]
