"""The worker half of a KV connector (vLLM's KVConnectorBase_V1, worker role), called by the runner."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from metalserve.kvcache.connector.base import ConnectorMetadata, ConnectorOutput


class KVConnectorWorker(ABC):
    """Each step: `start_load_kv` before the forward, `wait_for_layer_load` per layer (a request whose
    blocks still load is not in the batch, so the forward never waits), `save_kv` after the forward,
    `get_finished` for the step's report. `caches`: the runner's pools (one per pool tensor)."""

    @abstractmethod
    def start_load_kv(self, meta: ConnectorMetadata | None, caches: Sequence[Any]) -> None:
        """Begin this step's loads and put every finished one into the pools."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until `layer`'s pages of this step's batch are in (nothing to wait for here)."""
        return None

    @abstractmethod
    def save_kv(self, meta: ConnectorMetadata | None, caches: Sequence[Any]) -> None:
        """Start saving this step's computed full blocks (after the forward's arrays are evaluated)."""

    @abstractmethod
    def wait_for_save(self, timeout: float | None = None) -> bool:
        """Block until every started save ended; False if `timeout` passed first."""

    @abstractmethod
    def get_finished(self) -> ConnectorOutput | None:
        """The loads that finished since the last call (None: nothing to report)."""

    def close(self) -> None:
        """Stop background threads (queued saves are finished first)."""
        return None
