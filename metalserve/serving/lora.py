"""--enable-lora at build time: wrap the model's linears, load the --lora-modules adapters, and size the
room the pool plan leaves for the adapters still to come."""

from __future__ import annotations

import logging

import mlx.nn as nn

from metalserve.config import ConfigError, EngineConfig
from metalserve.executor.models.families import model_family
from metalserve.kvcache.plan import lora_reserve_bytes
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
    slots = LoraSlots(install_lora_layers(model), config.max_loras, config.max_lora_rank)
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


def lora_reserve(config: EngineConfig, slots: LoraSlots | None) -> int:
    """Bytes the pool leaves for adapters loaded later (up to --max-loras of --max-lora-rank)."""
    if slots is None:
        return 0
    dims = [layer.in_out for layer in slots.layers.values()]
    return lora_reserve_bytes(dims, config.max_loras, config.max_lora_rank, slots.nbytes)
