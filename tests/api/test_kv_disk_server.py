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

from metalserve.api.app import build_app
from metalserve.api.metrics import StatLogState
from metalserve.api.settings import ServerSettings
from metalserve.engine.async_engine import AsyncEngine, IterationStats
from metalserve.engine.engine_thread import EngineThread
from metalserve.kvcache.connector.base import ConnectorStats
from metalserve.scheduler.stats import SchedulerStats
from tests.api.conftest import Served, live
from tests.api.fakes import tiny_tokenizer
from tests.engine.test_kv_disk import PROMPT, make_core
from tests.engine.test_kv_disk_hybrid import PROMPT as HYBRID_PROMPT
from tests.engine.test_kv_disk_hybrid import make_core as make_hybrid_core
from tests.engine.test_kv_disk_window import PROMPT as WINDOW_PROMPT
from tests.engine.test_kv_disk_window import make_core as make_window_core


@contextmanager
def disk_server(
    directory: Path, kv_dtype: str = "auto", windowed: bool = False, hybrid: bool = False
) -> Iterator[Served]:
    """`windowed`: a tiny gemma3_text (full-attention and sliding-window layer groups); `hybrid`: a tiny
    qwen3_5 (full-attention and recurrent-state layer groups)."""
    thread = EngineThread()  # as the server does: the core is built on the thread that steps it
    if windowed:
        core = thread.call(lambda: make_window_core(directory))
    elif hybrid:
        core = thread.call(lambda: make_hybrid_core(directory))
    else:
        core = thread.call(lambda: make_core(directory, kv_dtype=kv_dtype))
    engine = AsyncEngine(
        core, tiny_tokenizer(), model_name="tiny", max_model_len=128, eos_token_ids=set(), thread=thread
    )
    app = build_app(engine, ServerSettings(log_stats_interval=0))
    with live(Served(app, core, engine)) as served:  # type: ignore[arg-type]
        yield served


def complete(served: Served, prompt: list[int] = PROMPT) -> Any:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", timeout=120)
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)


def metric(served: Served, name: str) -> float:
    text = httpx.get(f"{served.url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])  # int8: codes and scales come back together
def test_a_restarted_server_serves_the_prefix_from_disk(tmp_path: Path, kv_dtype: str) -> None:
    with disk_server(tmp_path, kv_dtype) as first:
        cold = complete(first)
        assert metric(first, "vllm:external_prefix_cache_hits_total") == 0
    assert len(list(tmp_path.glob("*.safetensors"))) == 5  # written through; shutdown finished the queue
    with disk_server(tmp_path, kv_dtype) as second:  # the first one's shutdown finished its queued saves
        warm = complete(second)
        assert metric(second, "vllm:external_prefix_cache_hits_total") == 32
        assert metric(second, "vllm:external_prefix_cache_queries_total") == 40
        assert metric(second, "vllm:kv_disk_bytes_loaded_total") > 0 and metric(second, "vllm:kv_disk_usage_bytes") > 0
        assert "Disk KV hit rate: 80.0%" in second.app.state.metrics.log_state.line()
    # Greedy text equal to the cold run (the tokens against mlx-lm: tests/engine/test_kv_disk.py).
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
