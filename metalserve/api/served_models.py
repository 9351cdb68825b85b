"""Which models `metalserve serve` serves (one model argument; several; a models file), their names, the
one memory budget, and the ready registry over them (a single model is a registry of one)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from metalserve.api.frontend import Frontend
from metalserve.api.model_serving import ModelServing
from metalserve.api.settings import ServerSettings
from metalserve.config import ConfigError, EngineConfig
from metalserve.kvcache.plan import model_kv_share
from metalserve.serving.engine_loader import engine_loader, estimate_bytes, start_engine
from metalserve.serving.model_spec import ModelSpec, build_specs, read_models_file
from metalserve.serving.registry import ModelRegistry
from metalserve.units import format_bytes

logger = logging.getLogger("metalserve.server")


def default_memory_budget(config: EngineConfig) -> int:
    """--gpu-memory-utilization of the machine's memory, less what other programs hold now."""
    from metalserve.kvcache.plan import memory_limit
    from metalserve.serving.memory import machine_memory

    memory = machine_memory(held=0)
    return memory_limit(config.gpu_memory_utilization, memory.total, memory.available, memory.held)[0]


def single_model_spec(config: EngineConfig, settings: ServerSettings) -> ModelSpec:
    """The one model of `metalserve serve [MODEL]`, under --served-model-name or its readable name."""
    given = settings.served_model_name
    if len(given) > 1:
        raise ConfigError(f"--served-model-name is given {len(given)} times for one model: once per model argument")
    return ModelSpec.of(config, given[0] if given else ())


def model_specs(config: EngineConfig, settings: ServerSettings) -> list[ModelSpec]:
    """The model arguments (each with its --served-model-name, in order), then the models file's entries,
    with --pinned-models applied."""
    arguments = ([config.model] if config.model is not None else []) + list(settings.more_models)
    names = settings.served_model_name
    if len(names) > len(arguments):
        raise ConfigError(
            f"--served-model-name is given {len(names)} times for {len(arguments)} model argument(s): once per "
            "model argument, in order (a models file's entries take `served_model_name` in the file)"
        )
    entries: list[Any] = [
        {"model": model, "served_model_name": list(names[i])} if i < len(names) else model
        for i, model in enumerate(arguments)
    ]
    if settings.models:
        entries += read_models_file(settings.models)
    specs = build_specs(entries, config)
    served = {n for spec in specs for n in spec.names}
    unknown = [p for p in settings.pinned_models if p not in served]
    if unknown:
        raise ConfigError(f"--pinned-models {', '.join(unknown)}: no such served model ({', '.join(sorted(served))})")
    if config.pipeline_parallel_size > 1:
        raise ConfigError("--pipeline-parallel-size serves one model, not several")
    if config.tensor_parallel_size > 1:
        raise ConfigError("--tensor-parallel-size serves one model, not several")
    pins = set(settings.pinned_models)
    return [dataclasses.replace(s, pinned=True) if pins & set(s.names) else s for s in specs]


def with_kv_share(spec: ModelSpec, budget: int, num_models: int) -> ModelSpec:
    """A model without its own kv_cache_memory gets its share of the budget for its KV pool (the pool
    planner's `model_kv_share`)."""
    if spec.config.kv_cache_memory is not None:
        return spec
    share = model_kv_share(budget, num_models)
    return dataclasses.replace(spec, config=dataclasses.replace(spec.config, kv_cache_memory=share))


def build_registry(config: EngineConfig, settings: ServerSettings, frontend: Frontend) -> ModelRegistry[ModelServing]:
    """The ready registry: one model loaded now (a registry of one), or several loaded on first use."""
    if not settings.multi_model:
        spec = single_model_spec(config, settings)
        return frontend.registry_of_one(spec, start_engine(spec, settings.grammar))
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
        engine_loader(settings.grammar),
        frontend.make_serving,
        on_unload=frontend.model_unloaded,
        memory_budget=budget,
        idle_timeout=settings.model_idle_timeout,
        load_timeout=settings.model_load_timeout,
        estimate=estimate_bytes,
    )
