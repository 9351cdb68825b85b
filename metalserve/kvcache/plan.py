"""How big the KV pool may grow and how it starts: the budget, the cap, and the start-up line saying why."""

from __future__ import annotations

import logging
from typing import NamedTuple

from metalserve.config import EngineConfig
from metalserve.kvcache.sizing import blocks_for_request, num_blocks_for_budget
from metalserve.kvcache.specs import KVCacheSpec
from metalserve.serving.memory import (
    INITIAL_POOL_BLOCKS,
    available_memory_bytes,
    format_bytes,
    memory_limit,
    pool_block_cap,
    total_memory_bytes,
)

logger = logging.getLogger("metalserve.engine")


class KVPoolPlan(NamedTuple):
    num_blocks: int  # the most the pool may grow to
    initial_blocks: int  # what it allocates at start-up


def plan_kv_pool(
    config: EngineConfig, spec: KVCacheSpec, max_model_len: int, peak: int, held: int, extra_block_bytes: int = 0
) -> KVPoolPlan:
    """`spec`: the model's cache spec (its page dtype and block cost); `peak`: weights + activations of a
    warm-up step (0 with --kv-cache-memory); `held`: bytes this process holds already, which the OS no
    longer reports as available; `extra_block_bytes`: what each block id costs beside the model's cache
    (a draft model's K/V)."""
    per_block = spec.bytes_per_block + extra_block_bytes
    per_request = blocks_for_request(spec.groups, max_model_len, config.block_size)
    if config.kv_cache_memory is not None:
        budget, why = config.kv_cache_memory, "--kv-cache-memory"
    else:
        limit, why = memory_limit(config.gpu_memory_utilization, total_memory_bytes(), available_memory_bytes(), held)
        budget = limit - peak
        why = f"{why} - {format_bytes(peak)} weights and a warm-up step"
    fits = num_blocks_for_budget(budget, per_block, config.block_size, max_model_len, per_request)
    cap = pool_block_cap(config.max_num_seqs, max_model_len, config.block_size, per_request)
    num_blocks = min(fits, cap)
    initial = min(num_blocks, INITIAL_POOL_BLOCKS)
    capped = f", capped at --max-num-seqs {config.max_num_seqs} x {max_model_len} tokens" if cap < fits else ""
    logger.info(
        "KV budget %s (%s); KV cache dtype %s, %s per block; pool up to %d blocks of %d tokens (%s, %d tokens "
        "fit%s), %d allocated now (%s), growing as requests need them; max concurrency at %d tokens/request: "
        "%.1fx",
        format_bytes(budget),
        why,
        spec.page.describe(),
        format_bytes(per_block),
        num_blocks,
        config.block_size,
        format_bytes(per_block * num_blocks),
        num_blocks * config.block_size,
        capped,
        initial,
        format_bytes(per_block * initial),
        max_model_len,
        num_blocks / per_request,  # over every layer group a request holds blocks in
    )
    return KVPoolPlan(num_blocks, initial)
