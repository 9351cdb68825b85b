"""GGUFs of every mapped architecture (K-quant and Q5 tensors) serve through the real engine: mlx-lm's greedy
tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from metalserve.config import EngineConfig
from metalserve.loader import load_model
from metalserve.serving.build import build_engine_core
from tests.engine.test_core import run_all
from tests.executor.test_runner_golden import mlx_lm_greedy, prompts_of
from tests.loader.gguf_arch_models import reference_model, write_arch_gguf
from tests.loader.gguf_blocks import T

CASES = [("qwen2", T.Q5_1), ("qwen3", T.Q6_K), ("qwen3moe", T.Q4_K), ("gemma3", T.Q5_0), ("phi3", T.Q8_0)]


@pytest.mark.parametrize(("arch", "kind"), CASES, ids=[f"{a}-{k.name}" for a, k in CASES])
def test_gguf_serves_mlx_lm_greedy_tokens_batched_with_chunked_prefill(tmp_path: Path, arch: str, kind: T) -> None:
    path = tmp_path / f"{arch}.gguf"
    reference = reference_model(arch, write_arch_gguf(path, arch, kind))
    loaded = load_model(str(path))  # the CPU default: dequantized to fp32 at load
    prompts = prompts_of([5, 40, 23], loaded.config["vocab_size"], seed=3)
    expected = [mlx_lm_greedy(reference, p, 10) for p in prompts]
    config = EngineConfig(kv_cache_memory=1 << 23, max_num_batched_tokens=16, block_size=8)
    core = build_engine_core(config, loaded)
    got, _ = run_all(core, prompts, 10)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
