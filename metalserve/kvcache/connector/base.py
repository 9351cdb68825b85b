"""The scheduler half of a KV connector: how many more prefix tokens it can supply, which blocks to
load and save this step, and what to do when loads finish (vLLM's KVConnectorBase_V1, scheduler role).

The flow of one request with an external hit:
1. Admission asks `get_num_new_matched_tokens` for tokens past the RAM prefix-cache hit.
2. The KV manager allocates fresh blocks for them; `update_state_after_alloc` records which block
   receives which stored block.
3. `build_connector_meta` hands those loads (and this step's saves) to the worker half with the step.
4. The request waits outside the batch until the worker reports its loads finished
   (`update_connector_output`); then it is scheduled from the first token after its last good block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from metalserve.kvcache.specs import LayerGroupSpec
from metalserve.request import Request


class BlockTransfer(NamedTuple):
    """One block's pages of layer group `group` between the pool (`block_id`) and the store (`key`)."""

    block_id: int
    key: str
    group: int = 0


@dataclass
class ConnectorMetadata:
    """What the worker half does this step: `loads` per request (in block order) before the forward,
    `saves` of computed full blocks after it."""

    loads: dict[str, list[BlockTransfer]] = field(default_factory=dict)
    saves: list[BlockTransfer] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.saves


@dataclass
class ConnectorOutput:
    """The worker's report after a step: for each request whose loads all ended, how many of its
    leading transfers arrived intact (a missing or corrupt block and everything after it is recomputed;
    the connector maps the count to tokens: `num_loaded_tokens`)."""

    finished_loads: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ConnectorStats:
    """Cumulative counters of a connector (vLLM-style metrics; tokens for queries and hits)."""

    queries: int = 0  # prompt tokens looked up past the RAM prefix cache
    hits: int = 0  # tokens loaded intact
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_seconds: float = 0.0
    usage_bytes: int = 0  # the store's size now
    capacity_bytes: int = 0


class KVConnectorScheduler(ABC):
    """The scheduler half; see the module docstring for the order of the calls."""

    def check_groups(self, specs: Sequence[LayerGroupSpec]) -> None:
        """Raise ValueError if this connector cannot serve a KV manager of these layer groups."""
        return None

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """How many tokens past `num_computed_tokens` (the RAM hit, a multiple of the block size) the
        connector can supply; they are loaded asynchronously, and at least one token is left to compute."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        """`block_ids`: the request's block table in every layer group after the allocation for the
        `num_external_tokens` tokens (0: nothing is loaded after all)."""

    def num_loaded_tokens(self, request: Request, num_intact: int) -> int:
        """Tokens past the RAM hit that the leading `num_intact` transfers of its loads supply."""
        return 0

    @abstractmethod
    def build_connector_meta(
        self,
        scheduled: dict[str, int],
        requests: dict[str, Request],
        block_ids: Callable[[str], tuple[list[int], ...]],
    ) -> ConnectorMetadata:
        """This step's loads and saves. `scheduled`: request id -> tokens run this step (their
        `num_computed_tokens` already count them); `block_ids`: a request's table in every group."""

    def update_connector_output(self, output: ConnectorOutput) -> None:
        """The worker's report of this step (finished loads)."""
        return None

    def request_finished(self, request: Request) -> None:
        """The request left the scheduler (its blocks are about to be freed)."""
        return None

    def stats(self) -> ConnectorStats:
        return ConnectorStats()
