"""The real loader of a served model: it builds the engine on the model's own thread, steps there, and an
unload lets go of every array the model held (nothing else keeps the core alive)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import mlx.core as mx

from metalserve.config import EngineConfig
from metalserve.engine.model_loader import UnloadedCore, estimate_bytes, load_engine
from metalserve.engine.model_spec import ModelSpec
from metalserve.engine.model_thread import start_engine_thread
from metalserve.sampling_params import SamplingParams
from tests.loader.tiny_models import write_mlx_dir


def test_load_step_and_unload_on_the_models_thread(tmp_path: Path) -> None:
    path = write_mlx_dir(tmp_path / "tiny", "llama")
    spec = ModelSpec(("tiny",), EngineConfig(model=str(path), kv_cache_memory=4 * 2**20, max_num_batched_tokens=64))
    assert estimate_bytes(spec) == (path / "model.safetensors").stat().st_size + 4 * 2**20
    before = mx.get_active_memory()
    loaded = start_engine_thread(spec, load_engine).result(timeout=120)
    core = weakref.ref(loaded.engine.core)
    assert loaded.thread is not None and loaded.engine.core.owner_thread == loaded.thread.ident  # type: ignore[attr-defined]
    assert loaded.weight_bytes > 0 and 0 < loaded.kv_bytes <= 4 * 2**20

    async def run() -> list[int]:
        loaded.engine.start()
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        tokens = [t for out in [o async for o in loaded.engine.generate([1, 2, 3], params, "r")] for t in out.token_ids]
        await loaded.engine.shutdown()
        return tokens

    assert len(asyncio.run(run())) == 5
    loaded.close().result(timeout=30)
    gc.collect()
    assert isinstance(loaded.engine.core, UnloadedCore) and core() is None  # the model's arrays are gone
    assert mx.get_active_memory() <= before
