"""`--pipeline-parallel-size N`, assembled: start or join the ranks, set each up (distributed/setup.py,
its pool sized by kvcache/plan.py), build rank 0's engine core and hand it to the server (ranks 1..N-1
serve the pipeline until rank 0 stops them)."""

from __future__ import annotations

import atexit
import logging
import os
import sys

import mlx.core as mx

from metalserve.config import EngineConfig
from metalserve.distributed.core import PipelineEngineCore
from metalserve.distributed.handshake import StartupError
from metalserve.distributed.launch import init_group, launched_externally, spawn_local_ranks
from metalserve.distributed.rank0 import PipelineRunner
from metalserve.distributed.setup import RankSetup, setup_rank, stage_spec
from metalserve.distributed.watchdog import Watchdog
from metalserve.distributed.worker import run_worker
from metalserve.executor.sampler import Sampler
from metalserve.loader import LoadedModel, ModelLoadError
from metalserve.serving.build import rank0_scheduler

logger = logging.getLogger("metalserve.distributed")


def run_rank(config: EngineConfig) -> int:
    """A rank other than 0: set up, then run steps until STOP. The exit status says how it ended."""
    return run_rank_in_group(config, init_group(config.world_size))


def start_pipeline(config: EngineConfig) -> tuple[PipelineEngineCore, LoadedModel, Watchdog]:
    """Rank 0's side (on a rank other than 0, started by mlx.launch, this serves and exits)."""
    children = [] if launched_externally() else spawn_local_ranks(config)
    core_ref: list[PipelineEngineCore] = []
    watchdog = Watchdog(children, config.pipeline_step_timeout, lambda: core_ref[0].waiting_since if core_ref else None)
    watchdog.start()  # from here a local rank that dies during start-up ends this process too
    group = init_group(config.world_size)
    if group.rank() != 0:
        sys.exit(run_rank_in_group(config, group))
    try:
        setup = setup_rank(config, group)
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


def run_rank_in_group(config: EngineConfig, group: mx.distributed.Group) -> int:
    try:
        setup = setup_rank(config, group)
        run_worker(setup, group, config.block_size, config.kv_cache_dtype, config.tensor_parallel_size)
    except (StartupError, ModelLoadError, ValueError, RuntimeError) as exc:  # RuntimeError: a peer went away
        logger.error("pipeline rank %d: %s", group.rank(), exc)
        return 1
    return 0


def build_core(config: EngineConfig, setup: RankSetup, group: mx.distributed.Group) -> PipelineEngineCore:
    loaded = setup.loaded
    spec = stage_spec(setup.model, config.block_size, config.kv_cache_dtype, setup.initial_blocks)
    runner = PipelineRunner(
        setup.model,
        spec,
        group,
        eos_token_ids=loaded.eos_token_ids,
        sampler=Sampler(config.seed),
        backend=setup.backend,
        tensor_parallel=config.tensor_parallel_size,
    )
    scheduler = rank0_scheduler(config, spec, setup.num_blocks, setup.max_model_len, setup.initial_blocks)
    logger.info(
        "pipeline: %d ranks, %d steps in flight; every rank runs the generic MLX path, attention %s",
        setup.size,
        2,
        setup.backend.description,
    )
    if config.async_scheduling:
        logger.info("async scheduling: off, the pipeline keeps its own 2 steps in flight through the ranks")
    return PipelineEngineCore(scheduler, runner, setup.max_model_len, depth=2)


def _stop(core: PipelineEngineCore, watchdog: Watchdog) -> None:
    """At exit: an orderly STOP down the pipeline (each rank reads it after any step still in flight),
    then wait for local ranks. After a failure nothing is sent (a send to a broken ring can block) and
    the process ends at once, with status 1."""
    watchdog.stopping = True
    if core.failed or watchdog.failed:
        watchdog.kill_children()
        logging.shutdown()
        os._exit(1)
    try:
        core.stop_pipeline()
    except RuntimeError as exc:
        logger.warning("pipeline: could not send STOP (%s)", exc)
    watchdog.stop_children()


def main() -> int:
    """`python -m metalserve.serving.pipeline`: a local rank started by rank 0 (distributed/launch.py), of a
    pipeline or of a tensor-parallel group."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    from metalserve.distributed.launch import config_from_env
    from metalserve.kernels.cpu import gemm, int8_dot

    config = config_from_env()
    int8_dot.set_mode(os.environ.get(int8_dot.RANKS_ENV, "off"))  # rank 0's --cpu-int8-activations
    gemm.set_bf16_mode(os.environ.get(gemm.BF16_RANKS_ENV, "off"))  # and --cpu-bf16-prefill
    if config.tensor_parallel_size > 1 and config.pipeline_parallel_size == 1:
        from metalserve.serving.tensor import run_tensor_rank

        return run_tensor_rank(config)
    return run_rank(config)


if __name__ == "__main__":
    sys.exit(main())
