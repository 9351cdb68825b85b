"""What every rank does at start-up: load the model, take its layer slice, size its KV pools, and agree
with the other ranks (handshake.py) before any step runs."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from metalserve.config import ConfigError, EngineConfig
from metalserve.distributed.handshake import RankReport, check_reports, exchange, fingerprint
from metalserve.distributed.partition import split_layers
from metalserve.distributed.shard import shard_model
from metalserve.distributed.stage import backbone_of, keep_layers, layer_bytes, non_layer_bytes
from metalserve.distributed.subgroup import TensorGroup, stage_tensor_group
from metalserve.executor.attention.base import AttentionBackend
from metalserve.executor.attention.select import select_attention
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.models.compute import MlxCompute
from metalserve.executor.models.families import load_model_for, model_family
from metalserve.executor.models.kv_layout import stage_layout
from metalserve.kvcache.plan import plan_stage_pool, stage_blocks_fit, stage_step_bytes
from metalserve.kvcache.specs import KVCacheDtype, KVCacheSpec
from metalserve.loader import LoadedModel
from metalserve.loader.weights_mode import fp32_bytes, parameter_bytes, should_dequantize
from metalserve.platform import current_platform
from metalserve.serving.context_len import resolve_max_model_len
from metalserve.serving.memory import machine_memory
from metalserve.units import format_bytes

logger = logging.getLogger("metalserve.distributed")


@dataclass
class RankSetup:
    rank: int
    size: int
    loaded: LoadedModel  # its model object holds only this rank's slice of the layers
    model: PagedModel
    layers: range
    backend: AttentionBackend[Any, Any]
    max_model_len: int
    num_blocks: int  # the pool's cap: the smallest any rank can hold
    initial_blocks: int
    reports: list[RankReport]


def _load_slice(
    config: EngineConfig, rank: int, size: int, tensor_group: TensorGroup | None = None
) -> tuple[LoadedModel, PagedModel, range, tuple[int, ...]]:
    """Load only this rank's layers: the split, the fingerprint and the whole model's KV layout (its layer
    groups, which every rank's block tables keep) are taken from the built model before its (lazy, for
    safetensors) weights are materialised, so the other layers never reach memory. With `tensor_group`
    (tensor parallelism inside each stage) the layers are split over it first, so the layout holds this
    rank's KV heads; its stage is `rank // tp` of `size // tp`."""
    found: dict[str, Any] = {}
    tp = 1 if tensor_group is None else tensor_group.size()

    def prepare(model: nn.Module) -> None:
        model_type = str(getattr(model, "model_type", ""))
        check_pipeline_model(model_type)
        found["fingerprint"] = fingerprint(model, loaded_config(model))
        sizes, extra = _resident_sizes(model, config)
        stage = rank // tp
        slices = split_layers(sizes, size // tp, extra, config.pipeline_layer_partition)
        if tensor_group is not None:
            shard_model(model, tensor_group)  # lazy slices of lazy weights: the dropped layers never load
        family = model_family(model_type)
        found["layout"], found["states"] = family.kv_layout(model), family.state_groups(model)
        found["layers"] = slices[stage]
        keep_layers(model, slices[stage], first=rank == 0)

    loaded = load_model_for(config, prepare)
    mx.clear_cache()
    # The generic MLX path on every rank: the host fast path (executor/host/) runs whole models only.
    layout = stage_layout(found["layout"], found["layers"])
    model = PagedModel(loaded.model, loaded.model_type, MlxCompute(), kv_layout=layout, state_groups=found["states"])
    return loaded, model, found["layers"], found["fingerprint"]


def check_pipeline_model(model_type: str) -> None:
    """Refuse, naming why, a family whose layers the stages cannot run apart (every KV kind is served:
    sliding-window groups, recurrent states and MLA's latent pages)."""
    why = model_family(model_type).not_split
    if why is not None:
        raise ConfigError(f"--pipeline-parallel-size: a {model_type} model cannot be split into stages yet: {why}")


def stage_spec(model: PagedModel, block_size: int, storage: KVCacheDtype, num_blocks: int = 0) -> KVCacheSpec:
    """A stage's KV spec: the whole model's layer groups over this slice's pool tensors and state slots."""
    return model.get_kv_cache_spec(model.family.page(model.model, storage), block_size, num_blocks)


def _resident_sizes(model: nn.Module, config: EngineConfig) -> tuple[list[int], int]:
    """Each layer's bytes and the rest's, as they will sit in memory: unpacked to fp32 where the loader
    will dequantize (MLX's CPU backend), else as stored."""
    whole = fp32_bytes(model)
    if should_dequantize(config.weights, whole, config.dequantize_max_bytes, current_platform().metal):
        sizes = [fp32_bytes(layer) for layer in backbone_of(model).layers]
        return sizes, whole - sum(sizes)
    return layer_bytes(model), non_layer_bytes(model)


def loaded_config(model: nn.Module) -> dict[str, object]:
    """The model's arguments as mlx-lm parsed them (the same on every rank that loaded the same model)."""
    return {k: v for k, v in vars(model.args).items() if isinstance(v, (int, float, str, bool, list, type(None)))}


def _blocks_fit(
    config: EngineConfig, loaded: LoadedModel, model: PagedModel, rank: int, tp: int = 1
) -> tuple[int, int]:
    """(KV blocks this rank can hold for its layers, bytes per block here): the facts of this rank, sized
    by the pool planner (kvcache/plan.py)."""
    per_block = stage_spec(model, config.block_size, config.kv_cache_dtype).bytes_per_block  # this rank's layers
    if config.kv_cache_memory is not None:
        return stage_blocks_fit(config, per_block, None, 0), per_block
    hidden = int(loaded.config.get("hidden_size", 0))
    inter = int(loaded.config.get("intermediate_size", 4 * hidden)) // tp  # this rank's MLP columns
    vocab = int(loaded.config.get("vocab_size", 0))
    itemsize = model.family.activation_dtype(model.model).size
    step = stage_step_bytes(config, itemsize, hidden, inter, vocab, first=rank == 0)
    return stage_blocks_fit(config, per_block, machine_memory(int(mx.get_active_memory())), step), per_block


def setup_rank(config: EngineConfig, group: mx.distributed.Group) -> RankSetup:
    """Load this rank's slice and agree with the others; StartupError if any rank cannot go on. With
    --tensor-parallel-size, world rank `stage * tp + t` holds tensor-parallel share t of stage's layers."""
    rank, size, tp = group.rank(), group.size(), config.tensor_parallel_size
    try:
        tensor_group = stage_tensor_group(group, tp) if tp > 1 else None
        loaded, model, layers, fp = _load_slice(config, rank, size, tensor_group)
        max_model_len = resolve_max_model_len(config, loaded.max_model_len, loaded.rope_scaled_len, warn=rank == 0)
        dtype = model.family.activation_dtype(model.model)
        backend = select_attention(
            config.attention_backend, dtype, current_platform(), kv_storage=config.kv_cache_dtype
        )
        backend.warm_up()  # every rank at once, here, rather than each in turn on the first request
        fits, per_block = _blocks_fit(config, loaded, model, rank, tp)
        weight_mib = parameter_bytes(model.model) >> 20
        report = RankReport(True, fp, fits, layers, weight_mib, per_block, "", config.block_size)
    except Exception as exc:  # reported to every rank, then raised here too
        exchange(RankReport.failed(f"{type(exc).__name__}: {exc}"), group)
        raise
    reports = exchange(report, group)
    check_reports(reports, tp=tp)
    groups = stage_spec(model, config.block_size, config.kv_cache_dtype).groups  # the same on every rank
    plan = plan_stage_pool(config, [r.blocks_fit for r in reports], max_model_len, groups)
    if rank == 0:
        log_ranks(reports, plan.num_blocks, config.block_size)
    return RankSetup(
        rank,
        size,
        loaded,
        model,
        layers,
        backend,
        max_model_len,
        plan.num_blocks,
        plan.initial_blocks,
        reports,
    )


def log_ranks(reports: list[RankReport], num_blocks: int, block_size: int) -> None:
    smallest = min(r.blocks_fit for r in reports)
    for rank, r in enumerate(reports):
        logger.info(
            "pipeline rank %d: layers %d-%d (%d), weights %d MiB, KV %s per block, room for %d blocks%s",
            rank,
            r.layers.start,
            r.layers.stop - 1,
            len(r.layers),
            r.weight_mib,
            format_bytes(r.kv_bytes_per_block),
            r.blocks_fit,
            " (the smallest: it sets the pool)" if r.blocks_fit == smallest else "",
        )
    logger.info("pipeline KV pool: up to %d blocks of %d tokens on every rank", num_blocks, block_size)
