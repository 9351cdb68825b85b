"""Images on a tiny random-weight Qwen2-VL or Gemma 3 (mlx-vlm's classes): the vision tower's time per
image, and the TTFT of a one-image chat request through the real threaded server, uncached and with the
same image again (a prefix-cache hit past the image). Prints numbers; run by hand:
    PYTHONPATH=. .venv/bin/python bench/vision.py [--model-type gemma3] [--size 448x448] [--repeats 5]
The models are tests/multimodal/tiny_vlm.py's and tiny_gemma3.py's (2 layers, hidden 64; Gemma 3's tower
takes 56x56 images, 4 placeholders, whatever --size): the numbers measure the serving path's overheads
(decode, resize, tower, scheduling), not a real model's compute.
"""

from __future__ import annotations

import argparse
import base64
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from metalserve.api.settings import ServerSettings  # noqa: E402
from metalserve.config import EngineConfig  # noqa: E402
from metalserve.multimodal.images import ImageLimits, open_image  # noqa: E402
from tests.api.conftest import live, serve_config  # noqa: E402
from tests.multimodal import tiny_gemma3, tiny_vlm  # noqa: E402
from tests.multimodal.vl_golden import png  # noqa: E402


def ttft(client: openai.OpenAI, model: str, image: bytes) -> float:
    url = f"data:image/png;base64,{base64.b64encode(image).decode()}"
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
    return first if first is not None else time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="448x448", help="image WIDTHxHEIGHT in pixels")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-type", choices=("qwen2_vl", "gemma3"), default="qwen2_vl")
    args = parser.parse_args()
    width, height = (int(x) for x in args.size.split("x"))
    size = (width, height)
    model = f"tiny-{args.model_type}"
    if args.model_type == "gemma3":
        directory = tiny_gemma3.save(tiny_gemma3.build(), Path(tempfile.mkdtemp()) / model)
    else:
        directory = tiny_vlm.save(tiny_vlm.build("qwen2_vl"), "qwen2_vl", Path(tempfile.mkdtemp()) / model)
    config = EngineConfig(model=str(directory), kv_cache_memory=1 << 26, max_model_len=4096)
    settings = ServerSettings(served_model_name=((model,),), log_stats_interval=0)
    with live(serve_config(config, settings)) as served:
        engine = served.engine
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x")
        ttft(client, model, png(1, size))  # warm-up: compiles, first allocations
        encoder = engine.core.runner.encoder_outputs  # type: ignore[attr-defined]
        seconds, count = encoder.encode_seconds, encoder.num_encoded
        cold = [ttft(client, model, png(200 + i, size)) for i in range(args.repeats)]
        per_image = (encoder.encode_seconds - seconds) / (encoder.num_encoded - count)
        warm = [ttft(client, model, png(200, size)) for _ in range(args.repeats)]
    processor = engine.image_processor
    slot = getattr(processor, "boi_token_id", processor.image_token_id)  # where the template puts an image
    _, [image] = processor.process([slot], [open_image(png(1, size), ImageLimits())])
    print(
        f"{args.model_type}, encode: {args.size} image ({image.length} placeholder tokens), "
        f"{per_image * 1e3:.0f} ms per image"
    )
    print(
        f"TTFT one image, uncached: {statistics.median(cold) * 1e3:.0f} ms median "
        f"({', '.join(f'{t * 1e3:.0f}' for t in cold)})"
    )
    print(
        f"TTFT same image again (prefix cache): {statistics.median(warm) * 1e3:.0f} ms median "
        f"({', '.join(f'{t * 1e3:.0f}' for t in warm)})"
    )


if __name__ == "__main__":
    main()
