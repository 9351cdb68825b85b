"""The real loader of a served model: it builds the engine on the model's own thread, steps there, and an
unload lets go of every array the model held (nothing else keeps the core alive)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import gguf
import mlx.core as mx
import pytest

from metalserve.config import EngineConfig
from metalserve.platform import current_platform
from metalserve.sampling_params import SamplingParams
from metalserve.serving.engine_loader import UnloadedCore, estimate_bytes, load_engine
from metalserve.serving.model_spec import ModelSpec
from metalserve.serving.model_thread import start_engine_thread
from tests.loader.tiny_models import write_gguf, write_mlx_dir


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


def test_a_gguf_to_be_dequantized_is_estimated_at_its_fp32_size(tmp_path: Path) -> None:
    """The budget check before a first load: a Q8_0 file dequantized to fp32 takes ~4x its size, not 1x."""
    path = tmp_path / "tiny.gguf"
    weights = write_gguf(path, gguf.GGMLQuantizationType.Q8_0)
    fp32 = 4 * sum(int(w.size) for w in weights.values())
    options = EngineConfig(model=str(path), weights="dequantize", kv_cache_memory=2**20, max_num_batched_tokens=64)
    dequantized = ModelSpec(("t",), options)
    stored = path.stat().st_size
    assert estimate_bytes(dequantized) == fp32 + stored + 2**20  # + the codes the CPU path keeps
    quantized = ModelSpec(("t",), EngineConfig(model=str(path), weights="quantized"))
    assert estimate_bytes(quantized) == stored
    loaded = start_engine_thread(dequantized, load_engine).result(timeout=120)
    try:  # the estimate is within a tenth of what the load measures (tied embeddings: one copy)
        assert abs(loaded.weight_bytes - (fp32 + stored)) <= 0.1 * loaded.weight_bytes
    finally:
        loaded.close().result(timeout=30)


def test_a_gguf_kept_in_its_codes_is_estimated_near_its_file_size(tmp_path: Path) -> None:
    """On the CPU path `--weights auto` keeps a llama GGUF in its packed codes (no fp32 copy): the estimate
    is the packed bytes from the header, not the fp32 size (before: 4x too high, and a budget that held the
    model refused it)."""
    if not current_platform().host_compute:
        pytest.skip("the codes path is MLX's CPU backend's")
    path = tmp_path / "tiny.gguf"
    weights = write_gguf(path, gguf.GGMLQuantizationType.Q8_0)
    fp32 = 4 * sum(int(w.size) for w in weights.values())
    spec = ModelSpec(("t",), EngineConfig(model=str(path), kv_cache_memory=2**20, max_num_batched_tokens=64))
    estimate = estimate_bytes(spec) - 2**20
    # 8-bit codes with a float16 scale and offset per 32 (1.125 bytes a weight, the file's 1.0625): far
    # below the fp32 copy (the norms, small here, count 4 bytes in both)
    assert 0.25 * fp32 < estimate < 0.3 * fp32
    loaded = start_engine_thread(spec, load_engine).result(timeout=120)
    try:  # what the load measures, within a tenth
        assert abs(loaded.weight_bytes - estimate) <= 0.1 * loaded.weight_bytes
    finally:
        loaded.close().result(timeout=30)
