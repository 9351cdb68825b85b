"""Gemma 3 with an image through the real threaded server (the engine thread loads a tiny Gemma 3
directory with mlx-vlm) and the official openai SDK: the template's `{"type": "image"}` part is where the
OpenAI `image_url` goes, the tokens are those of mlx-vlm's modules with HF's image mask, and the same
image again hits the prefix cache."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from metalserve.api.settings import ServerSettings
from metalserve.config import EngineConfig
from metalserve.multimodal.images import ImageLimits, open_image
from tests.api.conftest import Served, live, serve_config
from tests.multimodal.test_vision_api import data_url, token_ids
from tests.multimodal.tiny_gemma3 import bidirectional_reference, build, gemma_tokenizer, processor, prompt, save
from tests.multimodal.vl_golden import png

MODEL = "tiny-gemma3"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    directory = save(build(), tmp_path_factory.mktemp("gemma3") / MODEL)
    config = EngineConfig(
        model=str(directory),
        kv_cache_memory=1 << 24,
        max_num_batched_tokens=256,
        max_model_len=1024,
    )
    settings = ServerSettings(served_model_name=((MODEL,),), log_stats_interval=0)
    with live(serve_config(config, settings)) as running:
        yield running


def test_openai_image_on_gemma3(served: Served) -> None:
    oai = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
    image = png(1, (56, 56))
    text = "Describe the picture in a few words, please."
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    template_ids = gemma_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = template_ids if isinstance(template_ids, list) else template_ids["input_ids"]
    # The layout HF's processor gives (blank lines around the image; tests/multimodal/test_gemma3_prompt_ids.py).
    spaced = processor(gemma_tokenizer())
    tokens, images = spaced.process(list(ids), [open_image(image, ImageLimits())])
    assert len(tokens) == len(prompt(list(ids), [image])[0]) + 4
    want = bidirectional_reference(build(), tokens, images)
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": text}]

    def ask() -> openai.types.chat.ChatCompletion:
        return oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
            temperature=0,
            max_tokens=8,
            logprobs=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )

    first = ask()
    assert first.usage is not None and first.usage.prompt_tokens == len(tokens)
    assert token_ids(first) == want
    again = ask()
    assert token_ids(again) == want
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == len(tokens) // 16 * 16 > images[0].end
