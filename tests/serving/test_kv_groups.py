"""The engine builds the KV layer groups from the loaded model and says what prefix caching can do."""

from __future__ import annotations

import logging

import pytest

from metalserve.config import EngineConfig
from metalserve.executor.models.families import kv_cache_spec, kv_shape
from metalserve.kvcache.specs import FullAttention, KVCacheSpec, RecurrentState
from metalserve.serving import kv_groups
from tests.engine.test_core import tiny_loaded


def test_todays_models_are_one_full_attention_group(caplog: pytest.LogCaptureFixture) -> None:
    loaded = tiny_loaded()
    spec = kv_cache_spec(loaded, 8)
    shape = kv_shape(loaded)
    kv = {"num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim}
    assert spec.groups == (FullAttention(layers=tuple(range(shape.num_layers)), **kv),)
    with caplog.at_level(logging.INFO, logger="metalserve.engine"):
        s = kv_groups.build_scheduler(EngineConfig(block_size=8), spec, 64, 256, None)
    assert s.kv.specs == list(spec.groups) and s.kv.enable_caching
    assert f"FullAttention x{shape.num_layers}" in caplog.text


def test_a_state_without_snapshots_logs_that_prefix_caching_is_off(caplog: pytest.LogCaptureFixture) -> None:
    groups = (FullAttention(layers=(0,)), RecurrentState(layers=(1,), snapshots=False))
    spec = KVCacheSpec(groups, (FullAttention(),), block_size=8)
    with caplog.at_level(logging.INFO, logger="metalserve.engine"):
        s = kv_groups.build_scheduler(EngineConfig(block_size=8), spec, 64, 256, None)
    assert len(s.kv.groups) == 2 and not s.kv.enable_caching
    assert "prefix caching: layer group 1 keeps a recurrent state that cannot be snapshotted" in caplog.text
