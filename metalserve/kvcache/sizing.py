"""From a memory budget and the model's KV shape to a number of KV blocks."""

from __future__ import annotations

from collections.abc import Sequence

from metalserve.config import ConfigError
from metalserve.kvcache.block_pool import NUM_RESERVED_BLOCKS
from metalserve.kvcache.specs import LayerGroupSpec, RecurrentState
from metalserve.units import format_bytes


def blocks_for_request(specs: Sequence[LayerGroupSpec], num_tokens: int, block_size: int) -> int:
    """The most block ids one request of `num_tokens` tokens can hold at once, over every layer group:
    an attention group (full or sliding: a prefill chunk may span its whole prompt) one per `block_size`
    tokens, a recurrent state at most two."""
    per_group = -(-num_tokens // block_size)
    return sum(min(per_group, 2) if isinstance(s, RecurrentState) else per_group for s in specs)


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
