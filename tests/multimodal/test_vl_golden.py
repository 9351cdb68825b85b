"""Images through the real engine (scheduler, KV manager, runner) against mlx-vlm's own generation.

Tiny random-weight Qwen2-VL / Qwen2.5-VL models built with mlx-vlm's classes; greedy tokens must equal
mlx-vlm's `generate_step` for the same prompt and pixels.
"""

from __future__ import annotations

import pytest

from tests.multimodal.vl_golden import build, png, prompt, reference, serve, user, vl_engine

SYSTEM = {"role": "system", "content": "You are a careful assistant who looks at every picture twice."}


@pytest.fixture(scope="module")
def qwen2_vl():  # type: ignore[no-untyped-def]
    return build("qwen2_vl")


def test_one_image_matches_mlx_vlm(qwen2_vl) -> None:  # type: ignore[no-untyped-def]
    tokens, images = prompt([user("What is in the picture?")], [png(1)], "qwen2_vl")
    assert len(images) == 1 and images[0].length == 6  # 84x56 -> a 6x4 patch grid -> 3x2 merged
    want = reference(qwen2_vl, tokens, images)
    core = vl_engine("qwen2_vl", kv_cache_memory=None)  # the memory plan's warm-up step runs the model too
    [(got, _)] = serve(core, [(tokens, images)])
    assert got == want
    # The image matters: another image, same text, other tokens (in the reference and here).
    other_tokens, other_images = prompt([user("What is in the picture?")], [png(2)], "qwen2_vl")
    other_want = reference(qwen2_vl, other_tokens, other_images)
    assert other_want != want
    [(other, _)] = serve(core, [(other_tokens, other_images)], tag="o")
    assert other == other_want


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_two_images_and_an_image_in_the_second_turn(model_type: str) -> None:
    vlm = build(model_type)
    core = vl_engine(model_type)
    two = prompt([user("Compare them.", num_images=2)], [png(3, (112, 84)), png(4, (56, 56))], model_type)
    second_turn = prompt(
        [
            {"role": "user", "content": "Hello there."},
            {"role": "assistant", "content": "Hi! How can I help?"},
            user("And this one?"),
        ],
        [png(5, (140, 56))],
        model_type,
    )
    assert len(two[1]) == 2 and second_turn[1][0].offset > 20
    for tokens, images in (two, second_turn):
        [(got, _)] = serve(core, [(tokens, images)])
        assert got == reference(vlm, tokens, images)


@pytest.mark.slow
def test_batched_with_text_and_chunked_prefill(qwen2_vl) -> None:  # type: ignore[no-untyped-def]
    """A 16-token budget: the 48-token image spans several chunks and steps shared with text-only
    requests; it is encoded once."""
    image = prompt([SYSTEM, user("Look.")], [png(6, (224, 168))], "qwen2_vl")
    text = prompt([user("Only words here, no pictures at all.", num_images=0)], [], "qwen2_vl")
    assert image[1][0].length == 48
    want = [reference(qwen2_vl, *image), reference(qwen2_vl, *text)]
    core = vl_engine("qwen2_vl", budget=16)
    got = serve(core, [image, text, image], tag="b")
    assert [g for g, _ in got] == [want[0], want[1], want[0]]
    assert core.runner.encoder_outputs is not None and core.runner.encoder_outputs.num_encoded == 1


def test_prefix_cache_keys_on_the_image(qwen2_vl) -> None:  # type: ignore[no-untyped-def]
    """The same image again hits the cache past the image; a different image with the same text hits
    only the text blocks before it, and its tokens are the reference's for that image."""
    brief = {"role": "system", "content": "Be brief."}  # 26 tokens before the image: one full text block
    first = prompt([brief, user("What?")], [png(7, (224, 168))], "qwen2_vl")
    other = prompt([brief, user("What?")], [png(8, (224, 168))], "qwen2_vl")
    assert first[0] == other[0]  # identical token ids: only the pixels differ
    image = first[1][0]
    core = vl_engine("qwen2_vl")
    [(want_first, cached)] = serve(core, [first], tag="a")
    assert cached == 0
    [(again, cached_again)] = serve(core, [first], tag="b")
    assert again == want_first and cached_again >= image.end // 16 * 16 > image.offset
    [(got_other, cached_other)] = serve(core, [other], tag="c")
    assert cached_other == image.offset // 16 * 16  # the blocks before the image only
    assert got_other == reference(qwen2_vl, *other)
    assert want_first == reference(qwen2_vl, *first) != got_other
