"""The disk tier's start-up: which models it serves, the store, and the two connector halves."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from metalserve.config import ConfigError, EngineConfig
from metalserve.executor.connector.disk import DiskConnectorWorker
from metalserve.executor.connector.fingerprint import model_fingerprint
from metalserve.executor.connector.pages import supported
from metalserve.executor.runner import ModelRunner
from metalserve.kvcache.connector.disk import DiskConnectorScheduler
from metalserve.kvcache.connector.keys import StoreNamespace
from metalserve.kvcache.connector.store import DiskStore
from metalserve.kvcache.specs import FullAttention, KVCacheSpec, LayerGroupSpec
from metalserve.loader import LoadedModel
from metalserve.scheduler.scheduler import Scheduler

logger = logging.getLogger("metalserve.kv_disk")


def disk_tier_problem(groups: Sequence[LayerGroupSpec], spec: KVCacheSpec | None = None) -> str | None:
    """Why the disk tier cannot serve a model with these layer groups yet, or None. Quantized pages
    (int8/q4) are served: their codes, scales and biases are stored, keyed by the storage dtype."""
    if len(groups) != 1 or not isinstance(groups[0], FullAttention):
        kinds = ", ".join(type(g).__name__ for g in groups)
        return (
            f"the disk tier serves models of one full-attention layer group for now; this model has "
            f"{kinds} (sliding windows and recurrent-state snapshots are not stored yet)"
        )
    return None


def attach_disk_tier(
    config: EngineConfig, loaded: LoadedModel, spec: KVCacheSpec, scheduler: Scheduler, runner: ModelRunner
) -> DiskStore | None:
    """With --kv-disk-dir: open the store and attach both halves; refuse a model it cannot serve."""
    if config.kv_disk_dir is None:
        return None
    problem = disk_tier_problem(spec.groups, spec)
    if problem is None and not all(supported(c) for c in runner.kv):
        problem = f"the attention backend {runner.backend.name!r} keeps pools the disk tier cannot read"
    if problem is not None:
        raise ConfigError(f"--kv-disk-dir: {problem}; start without --kv-disk-dir")
    fingerprint = model_fingerprint(loaded.model, loaded.model_type, {"tensors": spec.tensors, "groups": spec.groups})
    store = DiskStore(config.kv_disk_dir, config.kv_disk_bytes)
    # The storage dtype from the spec family: the model's float dtype under "auto", else int8 / q4g64.
    namespace = StoreNamespace(fingerprint, 0, spec.page.key, config.block_size)
    scheduler.set_connector(DiskConnectorScheduler(store, namespace, scheduler.kv.chain_hashes))
    runner.connector = DiskConnectorWorker(store, config.block_size)
    logger.info("KV disk tier: model fingerprint %s, blocks of %d tokens", fingerprint, config.block_size)
    return store
