"""A model load that fails after its weights are in memory (here: its own --kv-cache-memory cannot hold
one request) gives every byte back: the error that reaches the client keeps no frame that holds them."""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
import pytest

from metalserve.config import ConfigError, EngineConfig
from metalserve.engine.engine_thread import EngineThread
from metalserve.serving.engine_loader import load_engine
from metalserve.serving.model_spec import ModelSpec
from tests.loader.tiny_models import write_mlx_dir


def test_a_failed_load_keeps_no_weights_alive(tmp_path: Path) -> None:
    directory = write_mlx_dir(tmp_path / "tiny", "llama")
    spec = ModelSpec(("tiny",), EngineConfig(model=str(directory), kv_cache_memory=1024, max_model_len=256))
    thread = EngineThread(name="test-failed-load")
    try:
        gc.collect()
        before = mx.get_active_memory()
        errors = []
        for _ in range(3):  # as the OpenAI SDK's retries of the 503 would
            with pytest.raises(ConfigError) as caught:
                thread.submit(load_engine, spec, thread).result()
            errors.append(caught.value)  # the registry keeps the error (chained into its 503) a while
        gc.collect()
        held = mx.get_active_memory() - before
        # Before: 1,089,800 bytes (the three tiny models); a few bytes of module-level constants may stay.
        assert held < 4096, f"{held} bytes of MLX arrays still alive after 3 failed loads"
    finally:
        thread.close()
