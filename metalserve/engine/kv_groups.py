"""The loaded model's layer groups, and the scheduler (with its KV manager) built over them."""

from __future__ import annotations

import logging

from metalserve.config import EngineConfig
from metalserve.executor.models.families import family_of
from metalserve.kvcache.specs import LayerGroupSpec, RecurrentState, prefix_caching_problem
from metalserve.loader import LoadedModel
from metalserve.scheduler.scheduler import Scheduler

logger = logging.getLogger("metalserve.engine")


def layer_groups(loaded: LoadedModel) -> list[LayerGroupSpec]:
    """The groups of the model's layers, one kind of cache each, group 0 full attention where the
    model has such layers (a model of one kind: one group of all layers, as before groups existed);
    a hybrid's recurrent-state layers come last, in a group of their own."""
    return _attention_groups(loaded) + _state_groups(loaded)


def _attention_groups(loaded: LoadedModel) -> list[LayerGroupSpec]:
    """Full attention and sliding windows, in groups of equal size (executor/models/kv_layout.py)."""
    return list(family_of(loaded).kv_layout(loaded.model).groups)


def _state_groups(loaded: LoadedModel) -> list[LayerGroupSpec]:
    """A hybrid's recurrent layers, in one group; a boundary state (conv + recurrent arrays) is the
    whole state, so it can be snapshotted for the prefix cache."""
    layers = family_of(loaded).state_layers(loaded.model)
    return [RecurrentState(layers=layers, snapshots=True)] if layers else []


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
