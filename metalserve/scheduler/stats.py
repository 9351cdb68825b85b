"""The one snapshot type of the scheduler and KV cache, for metrics and logs."""

from __future__ import annotations

from dataclasses import dataclass

from metalserve.kvcache.connector.base import ConnectorStats


@dataclass(frozen=True)
class SchedulerStats:
    """Counts now; cumulative prefix-cache (tokens, as vLLM counts them) and preemption counters; and
    `step_*`: how much each counter grew since the previous snapshot.

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
    step_prefix_cache_queries: int = 0
    step_prefix_cache_hits: int = 0
    step_preemptions: int = 0
    # Speculative decoding, cumulative (vLLM's spec_decode counters); 0 / () while off.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # A KV connector's cumulative counters (the disk tier); None while none is attached.
    connector: ConnectorStats | None = None


class StatsCounter:
    """Remembers the counters of the previous snapshot, to report per-step deltas."""

    def __init__(self) -> None:
        self._last = (0, 0, 0)

    def snapshot(
        self,
        *,
        num_running: int,
        num_waiting: int,
        kv_cache_usage: float,
        num_free_blocks: int,
        num_total_blocks: int,
        counters: tuple[int, int, int],
    ) -> SchedulerStats:
        """`counters`: cumulative (prefix-cache queries, prefix-cache hits, preemptions)."""
        last, self._last = self._last, counters
        queries, hits, preemptions = counters
        return SchedulerStats(
            num_running=num_running,
            num_waiting=num_waiting,
            kv_cache_usage=kv_cache_usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=preemptions,
            num_free_blocks=num_free_blocks,
            num_total_blocks=num_total_blocks,
            step_prefix_cache_queries=queries - last[0],
            step_prefix_cache_hits=hits - last[1],
            step_preemptions=preemptions - last[2],
        )
