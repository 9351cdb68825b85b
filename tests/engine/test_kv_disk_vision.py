"""The disk tier with images (tiny random Qwen2-VL and Gemma 3 built with mlx-vlm's classes): a returning
image prompt loads its prefix from disk after a restart and gives the tokens of a cold run; the image's
content hash is in every key of a block holding its placeholders, so another image with the same token ids
hits only the text before it; an image wholly inside the loaded prefix is not run through the tower, one
partly inside still is."""

from __future__ import annotations

from pathlib import Path

import pytest

from metalserve.engine.core import EngineCore
from metalserve.kvcache.connector.disk_scheduler import DiskConnectorScheduler
from metalserve.kvcache.connector.disk_store import SUFFIX
from metalserve.loader import LoadedModel
from metalserve.multimodal.inputs import MultiModalInput
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from tests.multimodal.vl_golden import png, prompt, serve, user, vl_engine

BLOCK = 16
BRIEF = {"role": "system", "content": "Be brief."}  # 26 tokens before the image: one full text block


def make_core(directory: Path | None, async_scheduling: bool | None = None) -> EngineCore:
    extra = {} if directory is None else {"kv_disk_dir": str(directory)}
    core = vl_engine("qwen2_vl", block_size=BLOCK, async_scheduling=async_scheduling, **extra)
    assert core.async_scheduling is bool(async_scheduling)
    return core


def connector(core: EngineCore) -> DiskConnectorScheduler:
    assert core.scheduler.kv_loads is not None
    c = core.scheduler.kv_loads.connector
    assert isinstance(c, DiskConnectorScheduler)
    return c


def disk_hits(core: EngineCore) -> int:
    stats = core.make_stats().connector
    assert stats is not None
    return stats.hits


def num_encoded(core: EngineCore) -> int:
    assert core.runner.encoder_outputs is not None
    return core.runner.encoder_outputs.num_encoded


def block_file(core: EngineCore, directory: Path, tokens: list[int], images: list[MultiModalInput], index: int) -> Path:
    probe = Request("probe", list(tokens), SamplingParams(), mm_inputs=list(images))
    core.scheduler.kv.hash_prompt(probe)
    return directory / (connector(core).namespace.key(probe.block_hashes[index]) + SUFFIX)


@pytest.fixture(scope="module")
def prompts() -> dict[str, tuple[list[int], list[MultiModalInput]]]:
    cat = prompt([BRIEF, user("What?")], [png(7, (224, 168))], "qwen2_vl")
    dog = prompt([BRIEF, user("What?")], [png(8, (224, 168))], "qwen2_vl")
    assert cat[0] == dog[0]  # identical token ids: only the pixels differ
    image = cat[1][0]
    assert BLOCK <= image.offset < 2 * BLOCK and image.end < len(cat[0]) - BLOCK  # blocks 1-4 hold it
    return {"cat": cat, "dog": dog}


@pytest.mark.parametrize("async_scheduling", [None, True])
def test_an_image_prompt_comes_back_from_disk_after_a_restart(
    tmp_path: Path, prompts: dict[str, tuple[list[int], list[MultiModalInput]]], async_scheduling: bool | None
) -> None:
    cat, dog = prompts["cat"], prompts["dog"]
    cold = make_core(None)
    [(want, _)] = serve(cold, [cat], tag="c")
    [(want_dog, _)] = serve(cold, [dog], tag="d")
    assert want != want_dog

    first = make_core(tmp_path, async_scheduling)
    [(got, _)] = serve(first, [cat])
    assert got == want and num_encoded(first) == 1
    first.close()

    second = make_core(tmp_path, async_scheduling)  # a restart on the same directory
    [(got, cached)] = serve(second, [cat])
    loadable = (len(cat[0]) - 1) // BLOCK * BLOCK
    assert disk_hits(second) == cached == loadable > cat[1][0].end
    assert num_encoded(second) == 0  # the image's placeholders were all loaded: no tower run
    assert got == want
    second.close()

    third = make_core(tmp_path, async_scheduling)  # another image, same token ids: only block 0 (text) is the same
    [(got, cached)] = serve(third, [dog])
    assert disk_hits(third) == cached == BLOCK
    assert num_encoded(third) == 1 and got == want_dog
    third.close()


@pytest.mark.parametrize("async_scheduling", [None, True])
def test_an_image_partly_inside_the_loaded_prefix_is_still_encoded(
    tmp_path: Path, prompts: dict[str, tuple[list[int], list[MultiModalInput]]], async_scheduling: bool | None
) -> None:
    cat = prompts["cat"]
    cold = make_core(None)
    [(want, _)] = serve(cold, [cat], tag="c")
    first = make_core(tmp_path, async_scheduling)
    serve(first, [cat])
    first.close()

    second = make_core(tmp_path, async_scheduling)
    block_file(second, tmp_path, *cat, 3).unlink()  # the load stops before block 3: tokens 48.. are recomputed
    [(got, cached)] = serve(second, [cat])
    image = cat[1][0]
    assert disk_hits(second) == cached == 3 * BLOCK and image.offset < cached < image.end
    assert num_encoded(second) == 1  # its last placeholders are computed from the tower's output
    assert got == want
    second.close()


def test_the_fingerprint_covers_the_vision_tower_and_the_image_processor() -> None:
    """An image's pages come from the tower's weights and from the processor's pixels (the content hash
    in the chain is taken before processing): a change to either is another model on disk."""
    from mlx.utils import tree_flatten, tree_unflatten

    from metalserve.executor.connector.fingerprint import model_fingerprint
    from metalserve.multimodal.processor import QwenVLImageProcessor
    from metalserve.serving.kv_disk import fingerprinted
    from tests.multimodal.tiny_vlm import build, config
    from tests.multimodal.vl_golden import loaded_vlm

    def fingerprint(loaded: LoadedModel) -> str:
        return model_fingerprint(*fingerprinted(loaded, {"tensors": [], "groups": []}))

    base = loaded_vlm(build("qwen2_vl"), "qwen2_vl")
    retuned = loaded_vlm(build("qwen2_vl"), "qwen2_vl")
    assert retuned.vision is not None
    name, weight = next((n, w) for n, w in tree_flatten(retuned.vision.parameters()) if n.startswith("vision_tower"))
    retuned.vision.update(tree_unflatten([(name, weight + 1)]))
    resized = loaded_vlm(build("qwen2_vl"), "qwen2_vl")
    options = {"patch_size": 14, "temporal_patch_size": 2, "max_pixels": 56 * 56 * 4}  # a smaller resize
    resized.image_processor = QwenVLImageProcessor(config()["image_token_id"], 2, options)
    text_only = loaded_vlm(build("qwen2_vl"), "qwen2_vl")
    text_only.vision = None
    prints = [fingerprint(x) for x in (base, retuned, resized, text_only)]
    assert len(set(prints)) == 4
    assert fingerprint(loaded_vlm(build("qwen2_vl"), "qwen2_vl")) == prints[0]  # the same model again


def test_gemma3_images_with_sliding_window_layers_come_back_from_disk_mid_image(tmp_path: Path) -> None:
    """Gemma 3: a sliding-window layer group beside the full one, and image tokens that attend to each
    other both ways. The load stops inside the image (the full group's block 3 is gone): the rest of the
    image is computed from the tower's output, seeing the loaded image tokens, as after a RAM hit there."""
    from tests.multimodal.tiny_gemma3 import BOI, gemma3_engine
    from tests.multimodal.tiny_gemma3 import prompt as gemma3_prompt

    tokens, images = gemma3_prompt([2, *range(10, 29), 9, BOI, *range(30, 40)], [png(1, (56, 56))])
    image = images[0]
    assert (image.offset, image.end, len(tokens)) == (22, 26, 37)  # blocks of 8: the image spans blocks 2 and 3

    def core(directory: Path | None) -> EngineCore:
        extra = {} if directory is None else {"kv_disk_dir": str(directory)}
        return gemma3_engine(block_size=8, **extra)  # type: ignore[no-any-return]

    [(want, _)] = serve(core(None), [(tokens, images)], tag="c")
    first = core(tmp_path)
    serve(first, [(tokens, images)])
    first.close()
    assert connector(first).windows == [8, None] or connector(first).windows == [None, 8]
    full = connector(first).windows.index(None)
    probe = Request("probe", list(tokens), SamplingParams(), mm_inputs=list(images))
    first.scheduler.kv.hash_prompt(probe)
    # Gone before the restart indexes the directory: the window group's loads are planned for 3 blocks.
    (tmp_path / (connector(first).namespaces[full].key(probe.block_hashes[3]) + SUFFIX)).unlink()
    second = core(tmp_path)
    [(got, cached)] = serve(second, [(tokens, images)])
    assert disk_hits(second) == cached == 24 and image.offset < cached < image.end
    assert num_encoded(second) == 1
    assert got == want
    second.close()
