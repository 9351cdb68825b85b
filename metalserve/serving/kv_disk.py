"""The disk tier's start-up: which models it serves, the store, and the two connector halves."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from metalserve.config import ConfigError, EngineConfig
from metalserve.executor.connector.disk_worker import DiskConnectorWorker
from metalserve.executor.connector.fingerprint import kv_shaping_config, model_fingerprint
from metalserve.executor.connector.pages import supported
from metalserve.executor.runner import ModelRunner
from metalserve.kvcache.connector.disk_keys import StoreNamespace
from metalserve.kvcache.connector.disk_scheduler import DiskConnectorScheduler, group_needs
from metalserve.kvcache.connector.disk_store import DiskStore
from metalserve.kvcache.specs import KVCacheSpec, LayerGroupSpec, RecurrentState
from metalserve.loader import LoadedModel
from metalserve.scheduler.scheduler import Scheduler

logger = logging.getLogger("metalserve.kv_disk")


def disk_tier_problem(groups: Sequence[LayerGroupSpec], spec: KVCacheSpec | None = None) -> str | None:
    """Why the disk tier cannot serve a model with these layer groups, or None. Full attention (MLA
    latents included), sliding windows and recurrent states (hybrid models: the snapshot at each block
    boundary) are served, quantized pages (int8/q4) too: their codes, scales and biases are stored, keyed
    by the storage dtype."""
    for i, g in enumerate(groups):
        if isinstance(g, RecurrentState) and not g.snapshots:
            return f"layer group {i} keeps a recurrent state that cannot be snapshotted"
    return None


def fingerprinted(loaded: LoadedModel, layout: dict[str, Any]) -> tuple[Any, str, dict[str, Any]]:
    """What the model fingerprint covers: the weights and the KV `layout` and, for a vision-language model,
    its vision tower too (the whole model) and the image processor's settings: an image's placeholder
    pages come from both, and its content hash in the block chain is taken from the decoded pixels. The
    config that shapes K/V (RoPE, norms, windows, overrides) is in it for every model."""
    extra = {**layout, "config": kv_shaping_config(loaded.config, loaded.model)}
    if loaded.vision is None:
        return loaded.model, loaded.model_type, extra
    if loaded.image_processor is not None:
        extra["image_processor"] = loaded.image_processor.settings()
    return loaded.vision, loaded.model_type, extra


def attach_disk_tier(
    config: EngineConfig, loaded: LoadedModel, spec: KVCacheSpec, scheduler: Scheduler, runner: ModelRunner
) -> DiskStore | None:
    """With --kv-disk-dir: open the store and attach both halves; refuse a model it cannot serve."""
    if config.kv_disk_dir is None:
        return None
    problem = disk_tier_problem(spec.groups, spec)
    if problem is None and spec.page.storage == "k8v4":
        problem = "k8v4 pages (K and V in formats of their own) are not stored on disk yet; int8 and q4 are"
    if problem is None and not all(supported(c) for c in runner.kv):
        problem = f"the attention backend {runner.backend.name!r} keeps pools the disk tier cannot read"
    if problem is not None:
        raise ConfigError(f"--kv-disk-dir: {problem}; start without --kv-disk-dir")
    layout: dict[str, Any] = {"tensors": spec.tensors, "groups": spec.groups}
    if runner.states is not None:  # a hybrid model: its state slots are stored too
        layout["states"] = runner.states.pool.layout
    fingerprint = model_fingerprint(*fingerprinted(loaded, layout))
    store = DiskStore(config.kv_disk_dir, config.kv_disk_bytes)
    # The storage dtype from the spec family: the model's float dtype under "auto", else int8 / q4g64.
    # The connector keys each layer group apart (the group index is in the key).
    namespace = StoreNamespace(fingerprint, 0, spec.page.key, config.block_size)
    needs = group_needs(spec.groups)
    scheduler.set_connector(DiskConnectorScheduler(store, namespace, scheduler.kv.chain_hashes, needs))
    runner.connector = DiskConnectorWorker(store, config.block_size, runner.states)
    logger.info("KV disk tier: model fingerprint %s, blocks of %d tokens", fingerprint, config.block_size)
    return store
