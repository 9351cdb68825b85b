"""Gemma 3 with images through the real engine (tiny random weights built with mlx-vlm's classes, a
sliding-window layer shorter than the prompt).

The tokens of one image attend to each other both ways (HF's Gemma 3 mask); mlx-vlm's own generation
attends causally, so the image requests are checked against mlx-vlm's modules run with HF's mask
(`bidirectional_reference`), and text-only requests against mlx-vlm's generation itself."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from metalserve.executor.attention.mlx_ops import _window_mask
from tests.multimodal.tiny_gemma3 import (
    BOI,
    WINDOW,
    bidirectional_reference,
    build,
    gemma3_engine,
    last_logits,
    prompt,
    reference,
)
from tests.multimodal.vl_golden import png, serve

TEXT_BEFORE = [2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]  # 20 tokens


@pytest.fixture(scope="module")
def gemma3() -> nn.Module:
    return build()


def test_image_tokens_see_each_other_whatever_the_window() -> None:
    mask = _window_mask(np.arange(4, 9), 9, window=2, key_start=0, spans=[(5, 8)])
    allowed = (mask == 0).astype(int)
    assert allowed.tolist() == [
        [0, 0, 0, 1, 1, 0, 0, 0, 0],  # text before the image: causal, window 2
        [0, 0, 0, 0, 1, 1, 1, 1, 0],  # image tokens: the window and the whole image, later ones too
        [0, 0, 0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 1, 1],  # after it: causal again
    ]


def test_one_image_batched_with_text(gemma3: nn.Module) -> None:
    image = prompt(TEXT_BEFORE + [BOI, 30, 31, 32, 33, 34, 35], [png(1, (56, 56))])
    text = prompt([2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [])
    assert image[1][0].offset == len(TEXT_BEFORE) + 1 and len(image[0]) > WINDOW * 3
    want = bidirectional_reference(gemma3, *image)
    # The mask matters: attending causally over the image gives other logits (the chunked test below gets
    # other tokens too).
    both_ways, causal = last_logits(gemma3, *image), last_logits(gemma3, *image, both_ways=False)
    assert float(mx.abs(both_ways - causal).max()) > 1e-3
    other = prompt(TEXT_BEFORE + [BOI, 30, 31, 32, 33, 34, 35], [png(2, (56, 56))])
    assert bidirectional_reference(gemma3, *other) != want  # the image matters
    core = gemma3_engine(kv_cache_memory=None)  # the memory plan's warm-up step runs the model too
    assert core.runner.backend.name == "mlx"  # auto picks the backend that masks per image
    [(alone, _)] = serve(core, [image], tag="a")
    assert alone == want
    got = serve(core, [other, text], tag="b")
    assert [g for g, _ in got] == [bidirectional_reference(gemma3, *other), reference(gemma3, *text)]


def test_chunked_prefill_keeps_an_image_whole_and_the_cache_hits(gemma3: nn.Module) -> None:
    """A 12-token budget: the chunk before the image stops short of it, so the image's 4 tokens attend
    each other in one forward; the same image again hits the prefix cache."""
    image = prompt(
        TEXT_BEFORE[:9] + [BOI, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 41, 42, 43, 44, 45], [png(2, (70, 42))]
    )
    assert image[1][0].offset == 10  # a 12-token chunk from 0 would split it at 12
    want = bidirectional_reference(gemma3, *image)
    core = gemma3_engine(budget=12)
    [(first, cached)] = serve(core, [image], tag="a")
    assert cached == 0 and first == want
    [(again, cached_again)] = serve(core, [image], tag="b")
    assert again == want and cached_again == len(image[0]) // 16 * 16 > image[1][0].end


def test_only_mlx_ops_serve_image_masks() -> None:
    from metalserve.config import ConfigError
    from metalserve.executor.attention.select import select_attention
    from metalserve.platform import current_platform

    platform = current_platform()
    assert select_attention("auto", mx.float32, platform, (16,), image_masks=True).name == "mlx"
    for name in ("cpu", "metal"):
        with pytest.raises(ConfigError, match="both ways"):
            select_attention(name, mx.float32, platform, (16,), image_masks=True)
