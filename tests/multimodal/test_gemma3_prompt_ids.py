"""Gemma 3 image prompts token for token as mlx-vlm's processor (HF's Gemma3Processor) builds them: the
template's `<start_of_image>` becomes "\\n\\n", `<start_of_image>`, the placeholders, `<end_of_image>`,
"\\n\\n", the blank lines merged with the newlines beside them; for one image, two, an image first in
the message and an image in a second turn."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from metalserve.loader.directory import _load_tokenizer
from metalserve.multimodal.images import ImageLimits, open_image
from metalserve.multimodal.processor import Gemma3ImageProcessor, image_processor_for
from tests.multimodal.tiny_gemma3 import BOI, EOI, IMAGE, TOKENS_PER_IMAGE, build, config, processor, save
from tests.multimodal.vl_golden import png

IMAGES = [png(1, (56, 56)), png(2, (70, 42))]


def image(n: int = 1) -> list[dict[str, str]]:
    return [{"type": "image"}] * n


def text(words: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": words}]


CASES = {
    "one image": [{"role": "user", "content": text("Look:\n") + image() + text("What is it?")}],
    "two images": [{"role": "user", "content": text("Compare ") + image(2) + text("\n\nWhich is brighter?")}],
    "image first": [{"role": "user", "content": image() + text("Describe it.")}],
    "second turn": [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": image() + text("And this one?")},
    ],
}


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(build(), tmp_path_factory.mktemp("gemma3") / "tiny-gemma3")


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_ids_equal_mlx_vlm_processor(directory: Path, case: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from mlx_vlm.utils import load_processor

    messages: Any = CASES[case]
    tokenizer = _load_tokenizer(directory)  # as the server loads it
    num_images = sum(p.get("type") == "image" for m in messages if isinstance(m["content"], list) for p in m["content"])
    files = IMAGES[:num_images]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    theirs = load_processor(directory)(
        text=rendered, images=[Image.open(io.BytesIO(f)) for f in files], return_tensors="np"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    ours = image_processor_for(config(), directory, tokenizer)
    assert isinstance(ours, Gemma3ImageProcessor)
    decoded = [open_image(f, ImageLimits()) for f in files]
    tokens, inputs = ours.process(list(ids), decoded)
    assert tokens == np.asarray(theirs["input_ids"])[0].tolist()
    for mm in inputs:  # each image's placeholders where the tower's features go, then <end_of_image>
        assert tokens[mm.offset - 1] == BOI and tokens[mm.offset : mm.end] == [IMAGE] * TOKENS_PER_IMAGE
        assert tokens[mm.end] == EOI
    # Without the tokenizer (the old layout): 4 blank-line tokens short per image with this tokenizer.
    assert len(processor().process(list(ids), decoded)[0]) == len(tokens) - 4 * num_images
