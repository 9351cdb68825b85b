"""The scheduler (with its KV manager) built over the model's layer groups (kvcache/specs.py)."""

from __future__ import annotations

import logging

from metalserve.config import EngineConfig
from metalserve.kvcache.specs import KVCacheSpec, prefix_caching_problem
from metalserve.scheduler.scheduler import Scheduler

logger = logging.getLogger("metalserve.engine")


def build_scheduler(
    config: EngineConfig,
    spec: KVCacheSpec,
    num_blocks: int,
    max_model_len: int,
    initial_blocks: int | None,
    mm_splittable: bool = True,
) -> Scheduler:
    groups = list(spec.groups)
    problem = prefix_caching_problem(groups)
    if problem and config.enable_prefix_caching:
        logger.warning("prefix caching: %s", problem)
    logger.info("KV cache layer groups: %s", ", ".join(f"{type(g).__name__} x{len(g.layers)}" for g in groups))
    return Scheduler(
        config, num_blocks, max_model_len, initial_blocks=initial_blocks, kv_groups=groups, mm_splittable=mm_splittable
    )
