"""`--tensor-parallel-size N`, assembled: start or join the ranks, load the model split over them
(distributed/shard.py), size each rank's pool of its own KV heads (kvcache/plan.py; the pool is the
smallest any rank holds, so block ids mean the same everywhere), agree (distributed/handshake.py), then
build rank 0's engine core; ranks 1..N-1 run the steps rank 0 broadcasts until it stops them."""

from __future__ import annotations

import atexit
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from metalserve.config import EngineConfig
from metalserve.distributed.handshake import RankReport, StartupError, check_reports, exchange, fingerprint
from metalserve.distributed.launch import init_group, launched_externally, spawn_local_ranks
from metalserve.distributed.setup import loaded_config
from metalserve.distributed.shard import TensorParallelError, shard_model
from metalserve.distributed.stage import Stage
from metalserve.distributed.tensor import TensorParallelCore, TensorParallelRunner, TensorParallelWorker, WholeForward
from metalserve.distributed.watchdog import Watchdog
from metalserve.executor.attention.base import AttentionBackend
from metalserve.executor.attention.select import select_attention
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.models.families import kv_cache_spec, kv_shape, load_model_for
from metalserve.executor.sampler import Sampler
from metalserve.kvcache.plan import plan_stage_pool, stage_blocks_fit, stage_step_bytes
from metalserve.loader import LoadedModel, ModelLoadError
from metalserve.loader.weights_mode import parameter_bytes
from metalserve.platform import current_platform
from metalserve.serving.build import rank0_scheduler
from metalserve.serving.context_len import resolve_max_model_len
from metalserve.serving.memory import machine_memory
from metalserve.units import format_bytes

logger = logging.getLogger("metalserve.distributed")
FLAG = "--tensor-parallel-size"


@dataclass
class TensorRankSetup:
    rank: int
    size: int
    loaded: LoadedModel  # its model holds this rank's heads and columns of every layer
    model: PagedModel
    backend: AttentionBackend[Any, Any]
    max_model_len: int
    num_blocks: int  # the pool's cap: the smallest any rank can hold
    initial_blocks: int
    reports: list[RankReport]


def _load_shard(config: EngineConfig, group: mx.distributed.Group) -> tuple[LoadedModel, PagedModel, tuple[int, ...]]:
    """Load the model split over `group`: the fingerprint is taken from the whole model, the split made
    before its (lazy, for safetensors) weights are materialised."""
    found: dict[str, tuple[int, ...]] = {}

    def prepare(model: nn.Module) -> None:
        found["fingerprint"] = fingerprint(model, loaded_config(model))
        shard_model(model, group)

    loaded = load_model_for(config, prepare)
    mx.clear_cache()
    # The generic MLX path: the host fast path (executor/host/) runs whole models in one process only.
    model = PagedModel(loaded.model, loaded.model_type, WholeForward())
    check_tensor_parallel_layout(model, loaded.model_type)
    return loaded, model, found["fingerprint"]


def check_tensor_parallel_layout(model: PagedModel, model_type: str) -> None:
    """Every rank builds every layer group's metadata and the recurrent states' plan (a pipeline stage's
    `Stage.context`), so sliding windows and gated-delta states split with their heads. MLA latent pages
    hold no heads to split: refused by name (no MLA family is in shard.py's list today; this guards it)."""
    if model.kv_layout.value_dim is not None:
        raise TensorParallelError(
            f"{FLAG}: a {model_type} model keeps MLA latent pages, shared by every head; they do not split over "
            "tensor-parallel ranks"
        )


def _blocks_fit(config: EngineConfig, loaded: LoadedModel, size: int, first: bool) -> tuple[int, int]:
    """(KV blocks this rank can hold of its own heads, bytes per block here)."""
    per_block = kv_cache_spec(loaded, config.block_size, config.kv_cache_dtype).bytes_per_block
    if config.kv_cache_memory is not None:
        return stage_blocks_fit(config, per_block, None, 0), per_block
    hidden = int(loaded.config.get("hidden_size", 0))
    inter = int(loaded.config.get("intermediate_size", 4 * hidden)) // size  # this rank's columns
    vocab = int(loaded.config.get("vocab_size", 0))
    step = stage_step_bytes(config, kv_shape(loaded).dtype.size, hidden, inter, vocab, first=first)
    return stage_blocks_fit(config, per_block, machine_memory(int(mx.get_active_memory())), step), per_block


def setup_tensor_rank(config: EngineConfig, group: mx.distributed.Group) -> TensorRankSetup:
    """Load this rank's shard and agree with the others; StartupError if any rank cannot go on."""
    rank, size = group.rank(), group.size()
    try:
        loaded, model, fp = _load_shard(config, group)
        max_model_len = resolve_max_model_len(config, loaded.max_model_len, loaded.rope_scaled_len, warn=rank == 0)
        backend = select_attention(
            config.attention_backend, kv_shape(loaded).dtype, current_platform(), kv_storage=config.kv_cache_dtype
        )
        backend.warm_up()  # every rank at once, here, rather than each in turn on the first request
        fits, per_block = _blocks_fit(config, loaded, size, rank == 0)
        heads = kv_shape(loaded).num_kv_heads
        weight_mib = parameter_bytes(model.model) >> 20
        # `layers` carries this rank's KV heads: every rank's range follows the previous one's.
        own = range(rank * heads, (rank + 1) * heads)
        report = RankReport(True, fp, fits, own, weight_mib, per_block, "", config.block_size)
    except Exception as exc:  # reported to every rank, then raised here too
        exchange(RankReport.failed(f"{type(exc).__name__}: {exc}"), group)
        raise
    reports = exchange(report, group)
    check_reports(reports, role="tensor-parallel")
    # A request holds blocks in every layer group (sliding windows, the recurrent-state group).
    groups = kv_cache_spec(loaded, config.block_size, config.kv_cache_dtype).groups
    plan = plan_stage_pool(config, [r.blocks_fit for r in reports], max_model_len, groups)
    if rank == 0:
        log_ranks(reports, plan.num_blocks, config.block_size)
    return TensorRankSetup(
        rank, size, loaded, model, backend, max_model_len, plan.num_blocks, plan.initial_blocks, reports
    )


def log_ranks(reports: list[RankReport], num_blocks: int, block_size: int) -> None:
    for rank, r in enumerate(reports):
        logger.info(
            "tensor-parallel rank %d: KV heads %d-%d of every layer, weights %d MiB, KV %s per block, room for "
            "%d blocks",
            rank,
            r.layers.start,
            r.layers.stop - 1,
            r.weight_mib,
            format_bytes(r.kv_bytes_per_block),
            r.blocks_fit,
        )
    logger.info("tensor-parallel KV pool: up to %d blocks of %d tokens on every rank", num_blocks, block_size)


def start_tensor_parallel(config: EngineConfig) -> tuple[TensorParallelCore, LoadedModel, Watchdog]:
    """Rank 0's side (on a rank other than 0, started by mlx.launch, this serves and exits)."""
    children = [] if launched_externally() else spawn_local_ranks(config)
    core_ref: list[TensorParallelCore] = []
    watchdog = Watchdog(
        children,
        config.pipeline_step_timeout,
        lambda: core_ref[0].waiting_since if core_ref else None,
        role="tensor-parallel",
    )
    watchdog.start()  # from here a local rank that dies during start-up ends this process too
    group = init_group(config.tensor_parallel_size, FLAG)
    if group.rank() != 0:
        sys.exit(run_tensor_rank_in_group(config, group))
    try:
        setup = setup_tensor_rank(config, group)
        core = build_core(config, setup, group)
    except BaseException as exc:
        watchdog.stopping = True  # our own error is the one to report, not the ranks it takes down
        watchdog.kill_children()
        if isinstance(exc, StartupError):
            raise ValueError(str(exc)) from exc
        raise
    core_ref.append(core)
    atexit.register(_stop, core, watchdog)
    return core, setup.loaded, watchdog


def run_tensor_rank(config: EngineConfig) -> int:
    """A rank other than 0 (started locally by rank 0, or by mlx.launch)."""
    return run_tensor_rank_in_group(config, init_group(config.tensor_parallel_size, FLAG))


def run_tensor_rank_in_group(config: EngineConfig, group: mx.distributed.Group) -> int:
    try:
        setup = setup_tensor_rank(config, group)
        spec = kv_cache_spec(setup.loaded, config.block_size, config.kv_cache_dtype, setup.initial_blocks)
        worker = TensorParallelWorker(Stage(setup.model, spec, setup.backend), group)
        logger.info("tensor-parallel rank %d ready", group.rank())
        worker.serve()
    except (StartupError, ModelLoadError, ValueError, RuntimeError) as exc:  # RuntimeError: a peer went away
        logger.error("tensor-parallel rank %d: %s", group.rank(), exc)
        return 1
    logger.info("tensor-parallel rank %d: stopped by rank 0 after %d steps", group.rank(), worker.steps)
    return 0


def build_core(config: EngineConfig, setup: TensorRankSetup, group: mx.distributed.Group) -> TensorParallelCore:
    loaded = setup.loaded
    spec = kv_cache_spec(loaded, config.block_size, config.kv_cache_dtype, setup.initial_blocks)
    runner = TensorParallelRunner(
        setup.model,
        spec,
        group,
        eos_token_ids=loaded.eos_token_ids,
        sampler=Sampler(config.seed),
        backend=setup.backend,
    )
    scheduler = rank0_scheduler(config, spec, setup.num_blocks, setup.max_model_len, setup.initial_blocks)
    logger.info(
        "tensor parallel: %d ranks, one step at a time; every rank runs the generic MLX path, attention %s",
        setup.size,
        setup.backend.description,
    )
    if config.async_scheduling:
        logger.info("async scheduling: off, every rank must run the same collectives in the same order")
    return TensorParallelCore(
        scheduler,
        runner,
        setup.max_model_len,
        weight_bytes=parameter_bytes(loaded.model),
        kv_bytes_per_block=spec.bytes_per_block,
        kv_pool_bytes=setup.num_blocks * spec.bytes_per_block,
    )


def _stop(core: TensorParallelCore, watchdog: Watchdog) -> None:
    """At exit: an orderly STOP to every rank, then wait for local ranks. After a failure nothing is sent
    (a collective over a broken ring can block) and the process ends at once, with status 1."""
    watchdog.stopping = True
    if core.failed or watchdog.failed:
        watchdog.kill_children()
        logging.shutdown()
        os._exit(1)
    try:
        core.stop_pipeline()
    except RuntimeError as exc:
        logger.warning("tensor parallel: could not send STOP (%s)", exc)
    watchdog.stop_children()
