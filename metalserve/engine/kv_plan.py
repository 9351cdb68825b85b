"""How big the KV pool may grow and how it starts: the budget, the cap, and the start-up line saying why."""

from __future__ import annotations

import logging
from typing import NamedTuple

from metalserve.config import EngineConfig
from metalserve.engine.kv_groups import layer_groups
from metalserve.engine.memory import (
    INITIAL_POOL_BLOCKS,
    available_memory_bytes,
    format_bytes,
    memory_limit,
    pool_block_cap,
    total_memory_bytes,
)
from metalserve.executor.models.families import family_of, kv_shape
from metalserve.kvcache.sizing import blocks_for_request, num_blocks_for_budget
from metalserve.loader import LoadedModel

logger = logging.getLogger("metalserve.engine")


class KVPoolPlan(NamedTuple):
    num_blocks: int  # the most the pool may grow to
    initial_blocks: int  # what it allocates at start-up


def plan_kv_pool(
    config: EngineConfig, loaded: LoadedModel, max_model_len: int, peak: int, held: int, extra_block_bytes: int = 0
) -> KVPoolPlan:
    """`peak`: weights + activations of a warm-up step (0 with --kv-cache-memory); `held`: bytes this
    process holds already, which the OS no longer reports as available; `extra_block_bytes`: what each
    block id costs beside the model's K/V (a hybrid model's recurrent-state slot, a draft model's K/V)."""
    per_block = kv_block_bytes(loaded, config.block_size) + extra_block_bytes
    per_request = blocks_for_request(layer_groups(loaded), max_model_len, config.block_size)
    if config.kv_cache_memory is not None:
        budget, why = config.kv_cache_memory, "--kv-cache-memory"
    else:
        limit, why = memory_limit(
            config.gpu_memory_utilization, total_memory_bytes(), available_memory_bytes(), held
        )
        budget = limit - peak
        why = f"{why} - {format_bytes(peak)} weights and a warm-up step"
    shape = kv_shape(loaded)
    fits = num_blocks_for_budget(
        budget, shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype.size,
        config.block_size, max_model_len, per_block=per_block, blocks_per_request=per_request,
    )  # fmt: skip
    cap = pool_block_cap(config.max_num_seqs, max_model_len, config.block_size, per_request)
    num_blocks = min(fits, cap)
    initial = min(num_blocks, INITIAL_POOL_BLOCKS)
    capped = f", capped at --max-num-seqs {config.max_num_seqs} x {max_model_len} tokens" if cap < fits else ""
    logger.info(
        "KV budget %s (%s); pool up to %d blocks of %d tokens (%s, %d tokens%s), %d allocated now (%s), "
        "growing as requests need them; max concurrency at %d tokens/request: %.1fx",
        format_bytes(budget), why, num_blocks, config.block_size, format_bytes(per_block * num_blocks),
        num_blocks * config.block_size, capped, initial, format_bytes(per_block * initial), max_model_len,
        num_blocks / per_request,  # over every layer group a request holds blocks in
    )  # fmt: skip
    return KVPoolPlan(num_blocks, initial)


def kv_block_bytes(loaded: LoadedModel, block_size: int) -> int:
    """What one block id costs: K/V of one group's layers, in every pool tensor (models/kv_layout.py)."""
    family = family_of(loaded)
    return family.kv_layout(loaded.model).bytes_per_block(family.activation_dtype(loaded.model).size, block_size)
