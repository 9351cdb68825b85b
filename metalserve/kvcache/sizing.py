"""From a memory budget and the model's KV shape to a number of KV blocks."""

from __future__ import annotations

from collections.abc import Sequence

from metalserve.config import ConfigError
from metalserve.engine.memory import format_bytes
from metalserve.kvcache.block_pool import NUM_RESERVED_BLOCKS
from metalserve.kvcache.specs import LayerGroupSpec, RecurrentState


def kv_bytes_per_block(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    block_size: int,
    state_bytes: int = 0,
    *,
    planes: int = 2,
) -> int:
    """Bytes of one block across all layers: K and V (`planes` 2), or MLA's latent K alone (`planes` 1),
    `block_size` tokens each, plus `state_bytes` (hybrid models: the recurrent-state slot every block id
    also owns, executor/state_cache.py)."""
    for name, value in [
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("dtype_bytes", dtype_bytes),
        ("block_size", block_size),
        ("planes", planes),
    ]:
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if state_bytes < 0:
        raise ValueError(f"state_bytes must not be negative, got {state_bytes}")
    return planes * num_layers * num_kv_heads * head_dim * dtype_bytes * block_size + state_bytes


def blocks_for_request(specs: Sequence[LayerGroupSpec], num_tokens: int, block_size: int) -> int:
    """The most block ids one request of `num_tokens` tokens can hold at once, over every layer group:
    an attention group (full or sliding: a prefill chunk may span its whole prompt) one per `block_size`
    tokens, a recurrent state at most two."""
    per_group = -(-num_tokens // block_size)
    return sum(min(per_group, 2) if isinstance(s, RecurrentState) else per_group for s in specs)


def num_blocks_for_budget(
    budget_bytes: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    block_size: int,
    max_model_len: int,
    *,
    per_block: int | None = None,
    blocks_per_request: int | None = None,
    planes: int = 2,
) -> int:
    """How many blocks fit in `budget_bytes`, counting the reserved null block (block 0).

    `per_block`: what one block id costs where the layer groups share the pool (KVLayout.bytes_per_block;
    default: every layer's K/V); `blocks_per_request`: the block ids one `max_model_len` request holds
    over all groups (`blocks_for_request`; default: one group's).

    Raises ConfigError when the budget cannot hold one request of `max_model_len` tokens plus the
    null block, saying how much memory is missing and which flags change it.
    """
    if max_model_len < 1:
        raise ConfigError(f"--max-model-len must be at least 1, got {max_model_len}")
    if per_block is None:
        per_block = kv_bytes_per_block(num_layers, num_kv_heads, head_dim, dtype_bytes, block_size, planes=planes)
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
