"""Gemma 3 with images through the real engine against mlx-vlm's own generation (tiny random weights,
a sliding-window layer shorter than the prompt)."""

from __future__ import annotations

import pytest

from tests.multimodal.tiny_gemma3 import BOI, WINDOW, build, gemma3_engine, prompt, reference
from tests.multimodal.vl_golden import png, serve

TEXT_BEFORE = [2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]  # 20 tokens


@pytest.fixture(scope="module")
def gemma3():  # type: ignore[no-untyped-def]
    return build()


def test_one_image_batched_with_text_matches_mlx_vlm(gemma3) -> None:  # type: ignore[no-untyped-def]
    image = prompt(TEXT_BEFORE + [BOI, 30, 31, 32, 33, 34, 35], [png(1, (56, 56))])
    text = prompt([2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [])
    assert image[1][0].offset == len(TEXT_BEFORE) + 1 and len(image[0]) > WINDOW * 3
    want = reference(gemma3, *image)
    other = prompt(TEXT_BEFORE + [BOI, 30, 31, 32, 33, 34, 35], [png(2, (56, 56))])
    assert reference(gemma3, *other) != want  # the image matters
    core = gemma3_engine(kv_cache_memory=None)  # the memory plan's warm-up step runs the model too
    [(alone, _)] = serve(core, [image], tag="a")
    assert alone == want
    got = serve(core, [other, text], tag="b")
    assert [g for g, _ in got] == [reference(gemma3, *other), reference(gemma3, *text)]


def test_same_image_twice_hits_the_prefix_cache(gemma3) -> None:  # type: ignore[no-untyped-def]
    image = prompt(TEXT_BEFORE + [BOI, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39], [png(3, (70, 42))])
    core = gemma3_engine()
    [(first, cached)] = serve(core, [image], tag="a")
    assert cached == 0 and first == reference(gemma3, *image)
    [(again, cached_again)] = serve(core, [image], tag="b")
    assert again == first and cached_again == len(image[0]) // 16 * 16 > image[1][0].end
