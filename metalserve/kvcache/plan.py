"""The one KV pool planner: from a memory budget and the model's KV spec to how many blocks the pool may
grow to and how many it starts with. Every route that builds an engine (one model, several models,
`generate`, pipeline stages) sizes its pool here. No MLX: the caller measures memory, this does arithmetic."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from metalserve.config import ConfigError, EngineConfig
from metalserve.kvcache.block_pool import NUM_RESERVED_BLOCKS
from metalserve.kvcache.specs import KVCacheSpec, LayerGroupSpec, RecurrentState
from metalserve.units import format_bytes

logger = logging.getLogger("metalserve.engine")

# The pool starts this small and doubles as it fills (metalserve/kvcache/block_pool.py).
INITIAL_POOL_BLOCKS = 256


class KVPoolPlan(NamedTuple):
    num_blocks: int  # the most the pool may grow to
    initial_blocks: int  # what it allocates at start-up


class PoolBudget(NamedTuple):
    """Bytes the KV pool may take, and why (for the start-up line)."""

    bytes: int
    why: str


class MachineMemory(NamedTuple):
    """What the caller measured: the machine's memory, what is free now (None: unknown), and what this
    process holds already (which the OS no longer reports as available)."""

    total: int
    available: int | None
    held: int


def blocks_for_request(specs: Sequence[LayerGroupSpec], num_tokens: int, block_size: int) -> int:
    """The most block ids one request of `num_tokens` tokens can hold at once, over every layer group:
    an attention group (full or sliding: a prefill chunk may span its whole prompt) one per `block_size`
    tokens, a recurrent state at most two."""
    per_group = -(-num_tokens // block_size)
    return sum(min(per_group, 2) if isinstance(s, RecurrentState) else per_group for s in specs)


def memory_limit(utilization: float, total: int, available: int | None, held: int) -> tuple[int, str]:
    """The bytes the server may use, and why: its share of total memory, unless less is free.

    `held` is what this process already holds (the loaded weights), which `available` no longer counts."""
    share = int(total * utilization)
    why = f"{100 * utilization:.0f}% of {format_bytes(total)}"
    if available is not None and available + held < share:
        return available + held, f"{format_bytes(available)} available + {format_bytes(held)} held (less than {why})"
    return share, why


def pool_budget(config: EngineConfig, memory: MachineMemory | None, peak: int) -> PoolBudget:
    """--kv-cache-memory as given, else the machine's share less `peak` (weights and a warm-up step).
    `memory` is None only with --kv-cache-memory (nothing was measured)."""
    if config.kv_cache_memory is not None:
        return PoolBudget(config.kv_cache_memory, "--kv-cache-memory")
    assert memory is not None, "without --kv-cache-memory the caller measures the machine's memory"
    limit, why = memory_limit(config.gpu_memory_utilization, memory.total, memory.available, memory.held)
    return PoolBudget(limit - peak, f"{why} - {format_bytes(peak)} weights and a warm-up step")


def pool_block_cap(
    max_num_seqs: int, max_model_len: int, block_size: int, blocks_per_request: int | None = None
) -> int:
    """More blocks than `max_num_seqs` requests of `max_model_len` tokens can never be in use at once.
    `blocks_per_request`: what one such request holds over all layer groups (default: one group's)."""
    per_request = -(-max_model_len // block_size) if blocks_per_request is None else blocks_per_request
    return max_num_seqs * per_request + NUM_RESERVED_BLOCKS


def num_blocks_for_budget(
    budget_bytes: int, per_block: int, block_size: int, max_model_len: int, blocks_per_request: int | None = None
) -> int:
    """How many blocks fit in `budget_bytes`, counting the reserved null block (block 0).

    `per_block`: what one block id costs (KVCacheSpec.bytes_per_block); `blocks_per_request`: the block
    ids one `max_model_len` request holds over all groups (`blocks_for_request`; default: one group's).

    Raises ConfigError when the budget cannot hold one request of `max_model_len` tokens plus the
    null block, saying how much memory is missing and which flags change it.
    """
    if max_model_len < 1:
        raise ConfigError(f"--max-model-len must be at least 1, got {max_model_len}")
    if per_block < 1:
        raise ValueError(f"a block must cost at least one byte, got {per_block}")
    num_blocks = max(budget_bytes, 0) // per_block
    if blocks_per_request is None:
        blocks_per_request = -(-max_model_len // block_size)
    needed = blocks_per_request + NUM_RESERVED_BLOCKS
    if num_blocks < needed:
        missing = needed * per_block - max(budget_bytes, 0)
        raise ConfigError(
            f"The KV cache budget of {format_bytes(max(budget_bytes, 0))} holds {num_blocks} blocks of "
            f"{block_size} tokens ({format_bytes(per_block)} each), but one request of max_model_len="
            f"{max_model_len} tokens needs {needed} blocks ({format_bytes(needed * per_block)}, including "
            f"the reserved null block): {format_bytes(missing)} missing. Raise --kv-cache-memory or "
            f"--gpu-memory-utilization, or lower --max-model-len."
        )
    return num_blocks


def plan_kv_pool(
    config: EngineConfig, spec: KVCacheSpec, max_model_len: int, budget: PoolBudget, extra_block_bytes: int = 0
) -> KVPoolPlan:
    """One model's pool. `spec`: its cache spec (page dtype and block cost); `budget`: `pool_budget`'s;
    `extra_block_bytes`: what each block id costs beside the model's cache (a draft model's K/V)."""
    per_block = spec.bytes_per_block + extra_block_bytes
    per_request = blocks_for_request(spec.groups, max_model_len, config.block_size)
    fits = num_blocks_for_budget(budget.bytes, per_block, config.block_size, max_model_len, per_request)
    cap = pool_block_cap(config.max_num_seqs, max_model_len, config.block_size, per_request)
    num_blocks = min(fits, cap)
    initial = min(num_blocks, INITIAL_POOL_BLOCKS)
    capped = f", capped at --max-num-seqs {config.max_num_seqs} x {max_model_len} tokens" if cap < fits else ""
    logger.info(
        "KV budget %s (%s); KV cache dtype %s, %s per block; pool up to %d blocks of %d tokens (%s, %d tokens "
        "fit%s), %d allocated now (%s), growing as requests need them; max concurrency at %d tokens/request: "
        "%.1fx",
        format_bytes(budget.bytes),
        budget.why,
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


def bytes_for_requests(spec: KVCacheSpec, num_requests: int, max_model_len: int) -> int:
    """The KV memory that holds `num_requests` requests at the full context at once, with the reserved
    null block (`generate`: the pool grows as used, so this costs nothing up front)."""
    blocks = num_requests * blocks_for_request(spec.groups, max_model_len, spec.block_size) + NUM_RESERVED_BLOCKS
    return blocks * spec.bytes_per_block


def model_kv_share(budget: int, num_models: int) -> int:
    """Several models: the KV pool of a model without its own kv_cache_memory, an equal share of half the
    budget, so every model's weights fit beside the pools (each pool starts small and grows up to that)."""
    return budget // (2 * num_models)


def stage_step_bytes(
    config: EngineConfig, itemsize: int, hidden: int, intermediate: int, vocab: int, first: bool
) -> int:
    """A pipeline stage's estimate of a full step's activations (no warm-up step runs across ranks): a
    few hidden-sized and MLP-sized rows per token, and on rank 0 the logits of every sampling row."""
    step = config.max_num_batched_tokens * itemsize * (8 * hidden + 3 * intermediate)
    return step + (config.max_num_seqs * vocab * 4 if first else 0)


def stage_blocks_fit(config: EngineConfig, per_block: int, memory: MachineMemory | None, step_bytes: int) -> int:
    """KV blocks one pipeline stage can hold for its layers (`memory`: None with --kv-cache-memory)."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory // per_block
    assert memory is not None, "without --kv-cache-memory the caller measures the machine's memory"
    limit, _ = memory_limit(config.gpu_memory_utilization, memory.total, memory.available, memory.held)
    return max(0, (limit - memory.held - step_bytes) // per_block)


def plan_stage_pool(
    config: EngineConfig, blocks_fit: Sequence[int], max_model_len: int, groups: Sequence[LayerGroupSpec] = ()
) -> KVPoolPlan:
    """Pipeline stages share block ids: the pool is the smallest any stage can hold, capped as always
    (`groups`: the whole model's layer groups, in each of which a request holds blocks; () counts one)."""
    per_request = blocks_for_request(groups, max_model_len, config.block_size) if groups else None
    cap = pool_block_cap(config.max_num_seqs, max_model_len, config.block_size, per_request)
    num_blocks = min(min(blocks_fit), cap)
    return KVPoolPlan(num_blocks, min(num_blocks, INITIAL_POOL_BLOCKS))
