"""Images through the real threaded server (the engine thread loads a tiny Qwen2-VL directory with
mlx-vlm and runs every step) and the official SDKs: OpenAI chat `image_url`, Anthropic `image` blocks in
a turn and in a `tool_result`, Responses `input_image`; the limits and bad images are 400s."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image

from metalserve.api.settings import ServerSettings
from metalserve.config import EngineConfig
from metalserve.multimodal.limits import ImageLimits
from tests.api.conftest import Served, live, serve_config
from tests.multimodal.tiny_vlm import build, save
from tests.multimodal.vl_golden import png, prompt, reference, user

MODEL = "tiny-qwen2-vl"  # the directory's name: the served model id
SETTINGS = ServerSettings(
    log_stats_interval=0,
    tool_call_parser="hermes",
    enable_auto_tool_choice=True,
    images=ImageLimits(max_images_per_request=3, max_image_pixels=1_000_000, max_image_bytes_per_request=400_000),
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    directory = save(build("qwen2_vl"), "qwen2_vl", tmp_path_factory.mktemp("vlm") / MODEL)
    config = EngineConfig(
        model=str(directory),
        kv_cache_memory=1 << 24,
        max_num_batched_tokens=256,
        max_model_len=2048,
    )
    with live(serve_config(config, SETTINGS)) as running:  # named by its directory, as `metalserve serve DIR`
        yield running


@pytest.fixture(scope="module")
def oai(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def ask(oai: openai.OpenAI, images: list[str], text: str = "What is in the picture?", **extra: Any) -> Any:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in images] + [{"type": "text", "text": text}]
    return oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],  # type: ignore[misc]
        temperature=0,
        max_tokens=8,
        logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **extra},
    )


def token_ids(completion: Any) -> list[int]:
    return [int(lp.token.removeprefix("token_id:")) for lp in completion.choices[0].logprobs.content]


def test_openai_image_matches_mlx_vlm_and_the_same_image_hits_the_prefix_cache(oai: openai.OpenAI) -> None:
    image = png(11, (224, 168))
    tokens, images = prompt([user("What is in the picture?")], [image], "qwen2_vl")
    assert images[0].length == 48 and images[0].offset < 16
    want = reference(build("qwen2_vl"), tokens, images)
    first = ask(oai, [data_url(image)])
    assert token_ids(first) == want
    details = first.usage.prompt_tokens_details
    assert first.usage.prompt_tokens == len(tokens) and (details is None or not details.cached_tokens)
    again = ask(oai, [data_url(image)])
    cached = (len(tokens) - 1) // 16 * 16  # every full block but the one holding the last token
    assert token_ids(again) == want and again.usage.prompt_tokens_details.cached_tokens == cached
    other = ask(oai, [data_url(png(12, (224, 168)))])  # same text, same token ids, other pixels
    assert not other.usage.prompt_tokens_details.cached_tokens  # its first block holds the image already


def test_anthropic_image_and_tool_result_with_an_image(served: Served) -> None:
    client = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(13)).decode()}
    messages: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "Take a screenshot."}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "image", "source": source}]},
                {"type": "image", "source": source},
                {"type": "text", "text": "Compare."},
            ],
        },
    ]
    tools: list[Any] = [{"name": "screenshot", "description": "screen", "input_schema": {"type": "object"}}]
    reply = client.messages.create(model=MODEL, max_tokens=4, messages=messages, tools=tools)
    assert reply.usage.input_tokens > 2 * 6 and reply.usage.output_tokens >= 1
    bad = {**source, "data": base64.b64encode(b"not an image at all").decode()}
    messages[2]["content"][0]["content"][0]["source"] = bad
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(model=MODEL, max_tokens=4, messages=messages, tools=tools)
    assert "could not process image" in str(error.value)


def test_responses_input_image(oai: openai.OpenAI) -> None:
    content: Any = [{"type": "input_image", "image_url": data_url(png(14))}, {"type": "input_text", "text": "Hi"}]
    response = oai.responses.create(model=MODEL, input=[{"role": "user", "content": content}], max_output_tokens=4)
    assert response.status in ("completed", "incomplete")  # max_output_tokens may cut it
    assert response.usage is not None and response.usage.input_tokens > 6


def _png_of(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("L", (width, height)).save(out, format="PNG")
    return out.getvalue()


BAD = {
    "http URL": ("http://example.com/cat.png", "not fetched"),
    "corrupt": (data_url(b"\x89PNG\r\n\x1a\n" + bytes(200)), "could not process image"),
    "truncated": (data_url(png(15, (300, 300))[:3000]), "corrupt or truncated"),
    "too many pixels": (data_url(_png_of(1200, 1000)), "1200x1000 = 1200000 pixels"),
    "bomb": (data_url(_png_of(20_000, 20_000)), "than the limit of 1000000"),  # 400 MP in ~400 KB
    "not base64": ("data:image/png;base64,@@@@", "not valid base64"),
    "svg": (data_url(b"<svg/>", "image/svg+xml"), "media type"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_images_and_limits_are_400s(oai: openai.OpenAI, case: str) -> None:
    url, words = BAD[case]
    with pytest.raises(openai.BadRequestError) as error:
        ask(oai, [url])
    assert words in str(error.value) and "messages[0].content[0]" in str(error.value)


def test_image_count_and_byte_limits(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="at most 3 images"):
        ask(oai, [data_url(png(16))] * 4)
    noise = (np.random.default_rng(0).random((300, 300, 3)) * 255).astype(np.uint8)
    big = io.BytesIO()
    Image.fromarray(noise).save(big, format="PNG")  # ~270 KB of incompressible pixels
    with pytest.raises(openai.BadRequestError, match="--max-image-bytes-per-request"):
        ask(oai, [data_url(big.getvalue())] * 2)
