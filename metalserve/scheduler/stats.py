"""A snapshot of the scheduler and KV cache for metrics and logs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    """Counts now, plus cumulative prefix-cache and preemption counters (tokens, as vLLM counts them).

    `num_total_blocks` excludes the reserved null block, so it equals `num_free_blocks` when idle.
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_total_blocks: int
