"""The engine builds the KV layer groups from the loaded model and says what prefix caching can do."""

from __future__ import annotations

import logging

import pytest

from metalserve.config import EngineConfig
from metalserve.engine import kv_groups
from metalserve.executor.models.families import kv_shape
from metalserve.kvcache.hybrid import HybridKVCacheManager
from metalserve.kvcache.manager import KVCacheManager
from metalserve.kvcache.specs import FullAttention, RecurrentState
from tests.engine.test_core import tiny_loaded


def test_todays_models_are_one_full_attention_group(caplog: pytest.LogCaptureFixture) -> None:
    loaded = tiny_loaded()
    assert kv_groups.layer_groups(loaded) == [FullAttention(layers=tuple(range(kv_shape(loaded).num_layers)))]
    with caplog.at_level(logging.INFO, logger="metalserve.engine"):
        s = kv_groups.build_scheduler(EngineConfig(block_size=8), loaded, 64, 256, None)
    assert type(s.kv) is KVCacheManager and s.kv.enable_caching
    assert f"FullAttention x{kv_shape(loaded).num_layers}" in caplog.text


def test_a_state_without_snapshots_logs_that_prefix_caching_is_off(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    groups = [FullAttention(layers=(0,)), RecurrentState(layers=(1,), snapshots=False)]
    monkeypatch.setattr(kv_groups, "layer_groups", lambda loaded: groups)
    with caplog.at_level(logging.INFO, logger="metalserve.engine"):
        s = kv_groups.build_scheduler(EngineConfig(block_size=8), tiny_loaded(), 64, 256, None)
    assert isinstance(s.kv, HybridKVCacheManager) and not s.kv.enable_caching
    assert "prefix caching: layer group 1 keeps a recurrent state that cannot be snapshotted" in caplog.text
