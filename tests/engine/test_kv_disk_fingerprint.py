"""The disk tier's model fingerprint covers the config that shapes K/V: a restart with another RoPE base
or scaling (as `--hf-overrides` gives) on a warm directory recomputes instead of serving stale pages."""

from __future__ import annotations

from pathlib import Path

from metalserve.config import EngineConfig
from metalserve.executor.connector.fingerprint import kv_shaping_config
from metalserve.loader import LoadedModel
from metalserve.serving.build import build_engine_core
from tests.engine.test_core import run_all
from tests.executor.test_runner_golden import mlx_lm_greedy, prompts_of
from tests.executor.tiny_models import TINY, tiny_model

BLOCK = 8
PROMPT = prompts_of([40], 97, seed=11)[0]


def loaded_with(**overrides: object) -> LoadedModel:
    """The same random weights (seed 0) built from a config with `overrides`, as --hf-overrides would."""
    config = {**TINY, "model_type": "llama", **overrides}
    return LoadedModel(
        model=tiny_model("llama", seed=0, **overrides),
        tokenizer=None,
        model_type="llama",
        config=config,
        max_model_len=256,  # type: ignore[arg-type]
        eos_token_ids=frozenset(),
        chat_template=None,
        source="tiny",
        weights_desc="fp32",
        blas_desc="-",
    )


def serve(directory: Path, loaded: LoadedModel) -> tuple[list[int], int]:
    config = EngineConfig(
        kv_cache_memory=1 << 22,
        block_size=BLOCK,
        max_num_batched_tokens=64,
        max_model_len=64,
        kv_disk_dir=str(directory),
    )  # type: ignore[arg-type]
    core = build_engine_core(config, loaded)
    got, _ = run_all(core, [PROMPT], 8)
    stats = core.make_stats().connector
    assert stats is not None
    core.close()
    return got["r0"], stats.hits


def test_a_rope_change_on_a_warm_directory_recomputes_and_answers_as_a_cold_run(tmp_path: Path) -> None:
    serve(tmp_path, loaded_with())  # warms the directory with rope_theta 10000
    for change in ({"rope_theta": 1e6}, {"rope_scaling": {"type": "linear", "factor": 4.0}}):
        changed = loaded_with(**change)
        cold = mlx_lm_greedy(changed.model, PROMPT, 8)
        got, hits = serve(tmp_path, changed)
        assert hits == 0, change  # before the fix: 32 tokens of pages computed under the old RoPE
        assert got == cold, change
    _, hits = serve(tmp_path, loaded_with())
    assert hits == 32  # the unchanged model still finds its own pages


def test_the_kv_shaping_config_leaves_out_only_what_cannot_change_a_page() -> None:
    base = {**TINY, "model_type": "llama", "eos_token_id": 2}
    shaping = kv_shaping_config(base)
    assert shaping == kv_shaping_config({**base, "eos_token_id": 7, "transformers_version": "5.0"})
    for key, value in (("rms_norm_eps", 1e-6), ("sliding_window", 32), ("torch_dtype", "bfloat16")):
        assert kv_shaping_config({**base, key: value}) != shaping, key
