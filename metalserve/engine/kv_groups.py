"""The loaded model's layer groups, and the scheduler (with its KV manager) built over them."""

from __future__ import annotations

import logging

from metalserve.config import EngineConfig
from metalserve.executor.models.hybrid_families import HYBRID_MODEL_TYPES, mixers_of
from metalserve.kvcache.specs import FullAttention, LayerGroupSpec, RecurrentState, prefix_caching_problem
from metalserve.loader import LoadedModel
from metalserve.scheduler.scheduler import Scheduler

logger = logging.getLogger("metalserve.engine")


def layer_groups(loaded: LoadedModel) -> list[LayerGroupSpec]:
    """One group per kind of cache the model's layers keep: full attention, then (hybrid models) the
    recurrent-state layers (models with sliding-window layers add their groups here)."""
    hybrid = _hybrid_groups(loaded)
    if hybrid is not None:
        return hybrid
    return [FullAttention(layers=tuple(range(loaded.num_layers)))]


def _hybrid_groups(loaded: LoadedModel) -> list[LayerGroupSpec] | None:
    """Attention layers in group 0, the recurrent ones in group 1; a boundary state (conv + recurrent
    arrays) is the whole state, so it can be snapshotted for the prefix cache."""
    if loaded.model_type not in HYBRID_MODEL_TYPES:
        return None
    mixers = mixers_of(loaded.model, loaded.model_type)
    attention = tuple(m.layer_idx for m in mixers if m.kind == "attention")
    state = tuple(m.layer_idx for m in mixers if m.kind == "state")
    return [FullAttention(layers=attention), RecurrentState(layers=state, snapshots=True)]


def state_group(groups: list[LayerGroupSpec]) -> int:
    """The index of the recurrent-state group (the runner reads that group's tables); 0 when none."""
    return next((i for i, g in enumerate(groups) if isinstance(g, RecurrentState)), 0)


def build_scheduler(
    config: EngineConfig, loaded: LoadedModel, num_blocks: int, max_model_len: int, initial_blocks: int | None
) -> Scheduler:
    groups = layer_groups(loaded)
    problem = prefix_caching_problem(groups)
    if problem and config.enable_prefix_caching:
        logger.warning("prefix caching: %s", problem)
    logger.info("KV cache layer groups: %s", ", ".join(f"{type(g).__name__} x{len(g.layers)}" for g in groups))
    return Scheduler(config, num_blocks, max_model_len, initial_blocks=initial_blocks, kv_groups=groups)
