"""The disk tier through the real threaded server and the openai SDK: a restart on the same directory
serves the prefix from disk, with the same greedy text, and /metrics and the stats line say so."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from metalserve.api.metrics import StatLogState
from metalserve.api.settings import ServerSettings
from metalserve.engine.async_engine import AsyncEngine, IterationStats
from metalserve.engine.engine_thread import EngineThread
from metalserve.executor.attention.metal import KernelAttention
from metalserve.kvcache.connector.base import ConnectorStats
from metalserve.scheduler.stats import SchedulerStats
from tests.api.conftest import Served, app_of_engine, live, serve_config
from tests.api.fakes import tiny_tokenizer
from tests.engine.test_kv_disk import PROMPT, make_core
from tests.engine.test_kv_disk_hybrid import PROMPT as HYBRID_PROMPT
from tests.engine.test_kv_disk_hybrid import make_core as make_hybrid_core
from tests.engine.test_kv_disk_metal import fake_a_mac
from tests.engine.test_kv_disk_window import PROMPT as WINDOW_PROMPT
from tests.engine.test_kv_disk_window import make_core as make_window_core


@contextmanager
def disk_server(
    directory: Path,
    kv_dtype: str = "auto",
    windowed: bool = False,
    hybrid: bool = False,
    async_scheduling: bool | None = None,
    attention_backend: str = "auto",
) -> Iterator[Served]:
    """`windowed`: a tiny gemma3_text (full-attention and sliding-window layer groups); `hybrid`: a tiny
    qwen3_5 (full-attention and recurrent-state layer groups)."""
    thread = EngineThread()  # as the server does: the core is built on the thread that steps it
    if windowed:
        core = thread.call(lambda: make_window_core(directory))
    elif hybrid:
        core = thread.call(lambda: make_hybrid_core(directory))
    else:
        core = thread.call(
            lambda: make_core(
                directory, kv_dtype=kv_dtype, async_scheduling=async_scheduling, attention_backend=attention_backend
            )
        )
    assert core.async_scheduling is bool(async_scheduling)
    engine = AsyncEngine(
        core, tiny_tokenizer(), model_name="tiny", max_model_len=128, eos_token_ids=set(), thread=thread
    )
    app = app_of_engine(engine, ServerSettings(log_stats_interval=0))
    with live(Served(app, core, engine)) as served:  # type: ignore[arg-type]
        yield served


def complete(served: Served, prompt: list[int] = PROMPT) -> Any:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=120)
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)


def metric(served: Served, name: str) -> float:
    text = httpx.get(f"{served.url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.parametrize(
    ("kv_dtype", "async_scheduling"),
    [("auto", None), ("int8", None), ("auto", True)],  # int8: codes and scales come back together
)
def test_a_restarted_server_serves_the_prefix_from_disk(
    tmp_path: Path, kv_dtype: str, async_scheduling: bool | None
) -> None:
    with disk_server(tmp_path, kv_dtype, async_scheduling=async_scheduling) as first:
        cold = complete(first)
        assert metric(first, "vllm:external_prefix_cache_hits_total") == 0
    assert len(list(tmp_path.glob("*.safetensors"))) == 5  # written through; shutdown finished the queue
    with disk_server(tmp_path, kv_dtype, async_scheduling=async_scheduling) as second:  # shutdown saved them all
        warm = complete(second)
        assert metric(second, "vllm:external_prefix_cache_hits_total") == 32
        assert metric(second, "vllm:external_prefix_cache_queries_total") == 40
        assert metric(second, "vllm:kv_disk_bytes_loaded_total") > 0 and metric(second, "vllm:kv_disk_usage_bytes") > 0
        assert "Disk KV hit rate: 80.0%" in second.app.state.metrics.log_state.line()
    # Greedy text equal to the cold run (the tokens against mlx-lm: tests/engine/test_kv_disk.py).
    assert warm.choices[0].text == cold.choices[0].text


def test_a_restarted_server_serves_the_metal_backends_int8_pages_from_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--attention-backend metal --kv-cache-dtype int8 on a faked Mac (tests/engine/test_kv_disk_metal.py):
    the Metal backend's own codes and scales are saved and come back after a restart."""
    fake_a_mac(monkeypatch)
    with disk_server(tmp_path, "int8", async_scheduling=True, attention_backend="metal") as first:
        backend = first.core.runner.backend  # type: ignore[attr-defined]
        assert isinstance(backend.inner, KernelAttention)
        cold = complete(first)
    assert len(list(tmp_path.glob("*.safetensors"))) == 5
    with disk_server(tmp_path, "int8", async_scheduling=True, attention_backend="metal") as second:
        warm = complete(second)
        assert metric(second, "vllm:external_prefix_cache_hits_total") == 32
    assert warm.choices[0].text == cold.choices[0].text


def test_a_restarted_server_serves_a_sliding_window_model_from_disk(tmp_path: Path) -> None:
    with disk_server(tmp_path, windowed=True) as first:
        cold = complete(first, WINDOW_PROMPT)
    assert len(list(tmp_path.glob("*.safetensors"))) == 12  # 6 blocks in each of the two layer groups
    with disk_server(tmp_path, windowed=True) as second:
        warm = complete(second, WINDOW_PROMPT)
        assert metric(second, "vllm:external_prefix_cache_hits_total") == 40
    # Greedy text equal to the cold run (the tokens against a run without the disk tier:
    # tests/engine/test_kv_disk_window.py).
    assert warm.choices[0].text == cold.choices[0].text


def test_a_restarted_server_serves_a_hybrid_model_from_disk_with_its_state_snapshot(tmp_path: Path) -> None:
    with disk_server(tmp_path, hybrid=True) as first:
        cold = complete(first, HYBRID_PROMPT)
    assert len(list(tmp_path.glob("*.safetensors"))) == 6  # 3 blocks of KV and 3 snapshots (16, 32, 48)
    with disk_server(tmp_path, hybrid=True) as second:
        warm = complete(second, HYBRID_PROMPT)
        # 2 blocks of KV and the state after token 32: prefill resumed at 32 of the 45 prompt tokens.
        assert metric(second, "vllm:external_prefix_cache_hits_total") == 32
    # Greedy text equal to the cold run (the tokens against a run without the disk tier, and against one
    # whose snapshot is not loaded: tests/engine/test_kv_disk_hybrid.py).
    assert warm.choices[0].text == cold.choices[0].text


def test_the_stats_line_shows_the_disk_hit_rate_since_the_previous_line() -> None:
    state = StatLogState()
    for queries, hits in [(40, 32), (140, 42)]:
        stats = ConnectorStats(queries=queries, hits=hits, usage_bytes=3 << 20)
        state.record(SchedulerStats(0, 0, 0.0, 0, 0, 0, 10, 10, connector=stats), IterationStats())
        line = state.line()
    assert "Disk KV hit rate: 10.0%, disk: 3 MiB" in line  # 10 of the last 100 tokens looked up


@contextmanager
def vision_disk_server(model_dir: Path, directory: Path) -> Iterator[Served]:
    """The real server on a saved tiny Qwen2-VL directory (loaded by mlx-vlm on the engine thread)."""
    from metalserve.config import EngineConfig

    config = EngineConfig(
        model=str(model_dir),
        kv_cache_memory=1 << 24,
        max_num_batched_tokens=256,
        max_model_len=2048,
        kv_disk_dir=str(directory),
    )
    settings = ServerSettings(served_model_name=(("tiny-vl",),), log_stats_interval=0)
    with live(serve_config(config, settings)) as served:
        yield served


def ask_about_image(served: Served, image: bytes) -> Any:
    import base64

    url = f"data:image/png;base64,{base64.b64encode(image).decode()}"
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=120, max_retries=0)
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is in the picture?"}]
    return client.chat.completions.create(
        model="tiny-vl",
        messages=[{"role": "user", "content": content}],  # type: ignore[misc]
        temperature=0,
        max_tokens=8,
        logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )


def answer_ids(completion: Any) -> list[int]:
    return [int(lp.token.removeprefix("token_id:")) for lp in completion.choices[0].logprobs.content]


def test_a_restarted_server_serves_an_image_prompt_from_disk(tmp_path: Path) -> None:
    """An image_url data URI through the openai SDK: after a restart the same image and text load their
    prefix from disk (the tower does not run for it) with the same answer; another image does not hit."""
    from tests.multimodal.tiny_vlm import build, save
    from tests.multimodal.vl_golden import png

    model_dir = save(build("qwen2_vl"), "qwen2_vl", tmp_path / "tiny-vl")
    image = png(11, (224, 168))  # 48 placeholder tokens from token 15 on: blocks 0-3 hold them
    with vision_disk_server(model_dir, tmp_path / "kv") as first:
        cold = ask_about_image(first, image)
    prompt_tokens = cold.usage.prompt_tokens
    loadable = (prompt_tokens - 1) // 16 * 16
    assert loadable >= 64
    with vision_disk_server(model_dir, tmp_path / "kv") as second:
        warm = ask_about_image(second, image)
        encoder = second.engine.core.runner.encoder_outputs  # an int read from the engine's thread's object
        assert encoder is not None and encoder.num_encoded == 0
        assert metric(second, "vllm:external_prefix_cache_hits_total") == loadable
        assert warm.usage.prompt_tokens_details.cached_tokens == loadable
        assert answer_ids(warm) == answer_ids(cold)
        other = ask_about_image(second, png(12, (224, 168)))  # same token ids, other pixels
        assert metric(second, "vllm:external_prefix_cache_hits_total") == loadable  # no new hit
        assert not other.usage.prompt_tokens_details.cached_tokens  # block 0 already holds the image
        assert encoder.num_encoded == 1
