"""--enable-lora at build time: give the model's linears their adapter slots and load the --lora-modules
adapters. The slots (--max-loras x --max-lora-rank in every linear) are allocated here, before the engine
measures its memory, so the pool plan counts them as held, with the weights.

Two routes: on the CPU fast path (the host compute, executor/host/) the slots follow its fused
projections and the numba decoder applies them (lora/fused.py); everywhere else each linear is wrapped
before paged attention is installed (lora/layers.py)."""

from __future__ import annotations

import logging

import mlx.nn as nn

from metalserve.config import ConfigError, EngineConfig
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.models.families import model_family
from metalserve.lora.experts import install_expert_layers
from metalserve.lora.files import AdapterError, read_adapter
from metalserve.lora.fused import install_fused_lora
from metalserve.lora.layers import AdapterTarget, LoraSlots, install_lora_layers
from metalserve.units import format_bytes

logger = logging.getLogger("metalserve.engine")


def prepare_lora(config: EngineConfig, model: nn.Module, model_type: str) -> LoraSlots | None:
    """The model's adapter slots with the start-up adapters loaded (before paged attention is installed,
    so the adapters' module paths are mlx-lm's); None without --enable-lora. ConfigError for a family
    the adapters cannot reach or an adapter that does not fit the model."""
    if not config.enable_lora:
        return None
    family = model_family(model_type)
    if family.hybrid or family.mla:
        raise ConfigError(f"--enable-lora: {model_type} models are not served with LoRA adapters yet")
    layers: dict[str, AdapterTarget] = {**install_lora_layers(model, config.max_loras, config.max_lora_rank)}
    layers |= install_expert_layers(model, config.max_loras, config.max_lora_rank)  # MoE experts (SwitchGLU)
    return _with_start_up_adapters(config, LoraSlots(layers, config.max_loras, config.max_lora_rank), "MLX")


def prepare_fast_path_lora(config: EngineConfig, model: PagedModel) -> LoraSlots:
    """The slots of a model on the CPU fast path (host compute installed), start-up adapters loaded."""
    targets, detached = install_fused_lora(model, config.max_loras, config.max_lora_rank)
    slots = LoraSlots(targets, config.max_loras, config.max_lora_rank, detached)
    route = "the CPU fast path" if getattr(model.compute, "forward_on_host", None) is not None else "MLX"
    return _with_start_up_adapters(config, slots, route)


def _with_start_up_adapters(config: EngineConfig, slots: LoraSlots, route: str) -> LoraSlots:
    logger.info(
        "LoRA: %d slots of rank %d in %d linear layers, %s, deltas on %s",
        config.max_loras,
        config.max_lora_rank,
        len(slots.layers),
        format_bytes(slots.nbytes),
        route,
    )
    for name, path in config.lora_modules:
        try:
            adapter = read_adapter(name, path, config.max_lora_rank)
            slots.load(adapter)
        except AdapterError as exc:
            raise ConfigError(f"--lora-modules: {exc}") from None
        logger.info(
            "LoRA adapter %s: rank %d, %d modules, %s",
            name,
            adapter.rank,
            len(adapter.modules),
            format_bytes(adapter.nbytes),
        )
    return slots
