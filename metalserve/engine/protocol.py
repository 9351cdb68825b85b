"""The synchronous engine-core interface that the async engine drives from its own worker thread."""

from __future__ import annotations

from typing import Protocol

from metalserve.outputs import EngineCoreOutput
from metalserve.request import Request
from metalserve.scheduler.stats import SchedulerStats

# One stats type in the project: the scheduler's snapshot (kept under this name for its readers).
SchedulerStatsLike = SchedulerStats


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
