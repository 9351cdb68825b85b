"""`metalserve serve` with several models: their specs, the one memory budget, and the registry."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from metalserve.api.settings import ServerSettings
from metalserve.config import ConfigError, EngineConfig
from metalserve.engine.model_loader import estimate_bytes, load_engine
from metalserve.engine.model_spec import ModelSpec, build_specs, read_models_file
from metalserve.engine.registry import ModelRegistry
from metalserve.units import format_bytes

logger = logging.getLogger("metalserve.server")


def default_memory_budget(config: EngineConfig) -> int:
    """--gpu-memory-utilization of the machine's memory, less what other programs hold now."""
    from metalserve.engine.memory import available_memory_bytes, memory_limit, total_memory_bytes

    return memory_limit(config.gpu_memory_utilization, total_memory_bytes(), available_memory_bytes(), 0)[0]


def model_specs(config: EngineConfig, settings: ServerSettings) -> list[ModelSpec]:
    """The model arguments, then the models file's entries, with --pinned-models applied."""
    entries: list[Any] = ([config.model] if config.model is not None else []) + list(settings.more_models)
    if settings.models:
        entries += read_models_file(settings.models)
    specs = build_specs(entries, config)
    names = {n for spec in specs for n in spec.names}
    unknown = [p for p in settings.pinned_models if p not in names]
    if unknown:
        raise ConfigError(f"--pinned-models {', '.join(unknown)}: no such served model ({', '.join(sorted(names))})")
    if config.pipeline_parallel_size > 1:
        raise ConfigError("--pipeline-parallel-size serves one model, not several")
    pins = set(settings.pinned_models)
    return [dataclasses.replace(s, pinned=True) if pins & set(s.names) else s for s in specs]


def with_kv_share(spec: ModelSpec, budget: int, num_models: int) -> ModelSpec:
    """A model without its own kv_cache_memory gets an equal share of half the budget for its KV pool, so
    every model's weights fit beside the pools (the pool starts small and grows up to that)."""
    if spec.config.kv_cache_memory is not None:
        return spec
    share = budget // (2 * num_models)
    return dataclasses.replace(spec, config=dataclasses.replace(spec.config, kv_cache_memory=share))


def build_registry(config: EngineConfig, settings: ServerSettings) -> ModelRegistry[Any]:
    specs = model_specs(config, settings)
    budget = settings.memory_budget if settings.memory_budget is not None else default_memory_budget(config)
    specs = [with_kv_share(s, budget, len(specs)) for s in specs]
    for s in specs:
        aliases = f" (aliases: {', '.join(s.aliases)})" if s.aliases else ""
        logger.info(
            "model %s%s: %s, KV pool up to %s%s",
            s.name,
            aliases,
            s.config.model or "embedded default",
            format_bytes(s.config.kv_cache_memory or 0),
            ", pinned" if s.pinned else "",
        )
    logger.info(
        "%d models within a memory budget of %s; idle ones unload after %s",
        len(specs),
        format_bytes(budget),
        f"{settings.model_idle_timeout:.0f} s" if settings.model_idle_timeout else "never (only to make room)",
    )
    return ModelRegistry(
        specs,
        load_engine,
        memory_budget=budget,
        idle_timeout=settings.model_idle_timeout,
        load_timeout=settings.model_load_timeout,
        estimate=estimate_bytes,
    )
