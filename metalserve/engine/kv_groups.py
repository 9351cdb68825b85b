"""The loaded model's layer groups, and the scheduler (with its KV manager) built over them."""

from __future__ import annotations

import logging

from metalserve.config import EngineConfig
from metalserve.kvcache.specs import FullAttention, LayerGroupSpec, prefix_caching_problem
from metalserve.loader import LoadedModel
from metalserve.scheduler.scheduler import Scheduler

logger = logging.getLogger("metalserve.engine")


def layer_groups(loaded: LoadedModel) -> list[LayerGroupSpec]:
    """One group per kind of cache the model's layers keep: every supported model today is all full
    attention (models with sliding-window or recurrent layers add their groups here)."""
    return [FullAttention(layers=tuple(range(loaded.num_layers)))]


def build_scheduler(
    config: EngineConfig, loaded: LoadedModel, num_blocks: int, max_model_len: int, initial_blocks: int | None
) -> Scheduler:
    groups = layer_groups(loaded)
    problem = prefix_caching_problem(groups)
    if problem and config.enable_prefix_caching:
        logger.warning("prefix caching: %s", problem)
    logger.info("KV cache layer groups: %s", ", ".join(f"{type(g).__name__} x{len(g.layers)}" for g in groups))
    return Scheduler(config, num_blocks, max_model_len, initial_blocks=initial_blocks, kv_groups=groups)
