"""Hybrid model directories load, state their layer groups and KV facts, and size the state honestly."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from metalserve.config import EngineConfig
from metalserve.executor.block_table import BlockTables
from metalserve.executor.models.families import SUPPORTED_MODEL_TYPES, kv_cache_spec, kv_shape, model_family
from metalserve.executor.models.hybrid import state_layout_of
from metalserve.generate import generate_config
from metalserve.kvcache.specs import FullAttention, RecurrentState
from metalserve.loader import load_model
from metalserve.serving.build import build_engine_core
from tests.loader.tiny_tokenizer import save_hf_tokenizer
from tests.models.hybrid_golden import engine, mlx_lm_greedy, prompts_of, serve
from tests.models.hybrid_tiny import _BASE, CONFIGS, HYBRID_TYPES, tiny_hybrid, tiny_hybrid_loaded

# Per type: (attention layers, recurrent layers) of the tiny configs.
GROUPS = {
    "qwen3_next": ((1, 3), (0, 2)),
    "qwen3_5": ((1, 3), (0, 2)),
    "qwen3_5_moe": ((1, 3), (0, 2)),
    "lfm2": ((1, 3), (0, 2)),
    "lfm2_moe": ((1, 3), (0, 2)),
    "nemotron_h": ((2,), (0, 3)),
    "granitemoehybrid": ((1,), (0, 2, 3)),
}


def test_every_hybrid_type_is_accepted_by_the_adapter_and_the_loader() -> None:
    assert {t for t in SUPPORTED_MODEL_TYPES if model_family(t).hybrid} == set(HYBRID_TYPES)


@pytest.mark.parametrize("model_type", HYBRID_TYPES)
def test_layer_groups_are_attention_then_recurrent_state(model_type: str) -> None:
    attention, state = GROUPS[model_type]
    loaded = tiny_hybrid_loaded(model_type)
    groups = kv_cache_spec(loaded, 16).groups
    assert [type(g) for g in groups] == [FullAttention, RecurrentState]
    assert (groups[0].layers, groups[1].layers) == (attention, state)
    assert groups[1] == RecurrentState(layers=state, snapshots=True, state_bytes=groups[1].state_bytes)
    assert groups[1].state_bytes == state_layout_of(loaded.model, model_type).slot_bytes > 0
    tables = BlockTables(groups, 16)
    assert (tables.attention_groups, tables.state_group) == ((0,), 1)


def test_the_state_layout_is_mlx_lm_s_own_cache_arrays() -> None:
    # qwen3_next: conv state (kernel-1 = 3 inputs of 2*16*2 + 16*4 channels), recurrent state [Hv, Dv, Dk] fp32.
    layout = state_layout_of(tiny_hybrid("qwen3_next"), "qwen3_next")
    conv, recurrent = layout.layers[0]
    assert (conv.shape, recurrent.shape, recurrent.dtype) == ((3, 128), (4, 16, 16), mx.float32)
    assert layout.slot_bytes == 2 * (3 * 128 * 4 + 4 * 16 * 16 * 4)
    # lfm2: the short conv keeps only its last L_cache-1 = 2 inputs.
    assert state_layout_of(tiny_hybrid("lfm2"), "lfm2").layers[0][0].shape == (2, 64)


def test_the_pool_counts_every_block_s_state_slot(caplog: pytest.LogCaptureFixture) -> None:
    loaded = tiny_hybrid_loaded("lfm2")
    with caplog.at_level(logging.INFO, logger="metalserve.engine"):
        core = engine(loaded, num_blocks=40, max_model_len=256)
    assert "recurrent state: 2 layers, 1.0 KiB per request" in caplog.text
    assert "KV cache layer groups: FullAttention x2, RecurrentState x2" in caplog.text
    spec = core.runner.spec
    layers, heads, head_dim = kv_shape(loaded)[:3]
    kv = 2 * layers * heads * head_dim * 4 * spec.block_size
    assert spec.bytes_per_block == kv + 2 * (2 * 64 * 4)
    assert core.runner.states is not None and core.runner.states.pool.num_blocks == spec.num_blocks


@pytest.mark.parametrize("model_type", ["qwen3_next", "nemotron_h"])
def test_a_model_directory_loads_and_serves_mlx_lm_s_tokens(tmp_path: Path, model_type: str) -> None:
    model = tiny_hybrid(model_type)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **_BASE, **CONFIGS[model_type]}))
    save_hf_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path), weights="dequantize")
    attention, _ = GROUPS[model_type]
    shape = kv_shape(loaded)
    assert (loaded.model_type, shape.num_layers, shape.num_kv_heads, shape.dtype) == (
        model_type,
        len(attention),
        2,
        mx.float32,
    )
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in loaded.model.named_modules())
    (prompt,) = prompts_of([30], seed=7)
    (got,) = serve(engine(loaded), [prompt], 8)
    assert got.tokens == mlx_lm_greedy(model_type, prompt, 8).tokens


def test_generate_sizes_the_pool_for_its_prompts_state_entries_included() -> None:
    loaded = tiny_hybrid_loaded("lfm2")
    config = generate_config(loaded, 2, EngineConfig(block_size=16, max_model_len=256))
    core = build_engine_core(config, loaded)
    assert core.scheduler.kv.pool.num_blocks == 2 * (16 + 2) + 1  # K/V, two state entries; the null block


def test_without_a_kv_budget_the_warm_up_step_runs_the_recurrent_layers_too() -> None:
    loaded = tiny_hybrid_loaded("qwen3_5")
    core = build_engine_core(EngineConfig(block_size=16, max_num_batched_tokens=64, max_model_len=256), loaded)
    assert core.runner.states is not None
    assert core.runner.states.pool.num_blocks == core.runner.spec.num_blocks
    (prompt,) = prompts_of([70], seed=8)
    (got,) = serve(core, [prompt], 6)
    assert got.tokens == mlx_lm_greedy("qwen3_5", prompt, 6).tokens
