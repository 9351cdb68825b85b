"""The synchronous engine-core interface that the async engine drives from its own worker thread."""

from __future__ import annotations

from typing import Protocol

from metalserve.outputs import EngineCoreOutput
from metalserve.request import Request


class SchedulerStatsLike(Protocol):
    """A snapshot of the scheduler and KV cache; the prefix-cache and preemption counts are cumulative."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0.0 .. 1.0
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    num_preemptions: int
    num_free_blocks: int
    num_total_blocks: int


class EngineCoreProtocol(Protocol):
    """Schedule -> execute -> update, one step at a time. Only one thread may call these methods."""

    def add_request(self, request: Request) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def finish_requests(self, request_ids: list[str]) -> None:
        """A stop string was found: finish these as "stop" and free their blocks."""
        ...

    def step(self) -> list[EngineCoreOutput]:
        """One schedule -> execute -> update; an empty list when there is nothing to run."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def make_stats(self) -> SchedulerStatsLike: ...
