"""--enable-lora at build time: wrap the model's linears with their adapter slots and load the
--lora-modules adapters. The slots (--max-loras x --max-lora-rank in every linear) are allocated here,
before the engine measures its memory, so the pool plan counts them as held, with the weights."""

from __future__ import annotations

import logging

import mlx.nn as nn

from metalserve.config import ConfigError, EngineConfig
from metalserve.executor.models.families import model_family
from metalserve.lora.files import AdapterError, read_adapter
from metalserve.lora.layers import LoraSlots, install_lora_layers
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
    layers = install_lora_layers(model, config.max_loras, config.max_lora_rank)
    slots = LoraSlots(layers, config.max_loras, config.max_lora_rank)
    logger.info(
        "LoRA: %d slots of rank %d in %d linear layers, %s",
        config.max_loras,
        config.max_lora_rank,
        len(layers),
        format_bytes(slots.nbytes),
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
