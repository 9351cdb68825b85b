"""The pieces of one model's engine core beside its pool: speculation (and a draft model), the vision
tower, async scheduling, and the warm-up step (a step's peak memory; the kernels compiled at start-up)."""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from metalserve.config import EngineConfig
from metalserve.executor.attention.base import AttentionBackend
from metalserve.executor.draft_model import build_draft_proposer
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.models.families import check_supported
from metalserve.executor.runner import ModelRunner
from metalserve.executor.sampler import Sampler
from metalserve.kvcache.specs import KVCacheSpec, LayerGroupSpec, RecurrentState
from metalserve.loader import LoadedModel, load_model
from metalserve.platform import Platform, return_freed_memory
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import NewRequestData, SchedulerOutput
from metalserve.spec_decode.proposer import Proposer, make_proposer
from metalserve.speculative_config import SpeculativeConfig

logger = logging.getLogger("metalserve.engine")


def async_scheduling_for(config: EngineConfig, speculation: SpeculativeConfig | None, metal: bool) -> bool:
    """Async scheduling as configured (by default: with Metal only), off (with a start-up line) where it
    cannot be correct yet."""
    if config.async_scheduling is None and not metal:
        # On MLX's CPU backend the overlapped work competes with the forward for the same cores:
        # bench/compare_peers.py measured TPOT 21-25 ms on against 13-16 ms off at concurrency 1.
        logger.info("async scheduling: off on MLX's CPU backend (--async-scheduling turns it on)")
        return False
    if config.async_scheduling is False:
        logger.info("async scheduling: off (--no-async-scheduling)")
        return False
    if speculation is not None:
        logger.info(
            "async scheduling: off, speculative decoding needs each step's accepted drafts before it schedules the next"
        )
        return False
    logger.info("async scheduling: on (step k+1 is scheduled while step k computes)")
    return True


def draft_for(
    config: EngineConfig, groups: list[LayerGroupSpec], draft: LoadedModel | None
) -> tuple[SpeculativeConfig | None, LoadedModel | None]:
    """The speculative config in force and, for method draft_model, its model: loaded here (before the
    memory plan, which counts its weights and the KV it keeps at every block id) unless given."""
    spec = speculation_for(config, groups)
    if spec is None or spec.method != "draft_model":
        return spec, None
    if draft is None:
        draft = load_model(
            spec.model,
            weights=config.weights,
            dequantize_max_bytes=config.dequantize_max_bytes,
            check_model_type=check_supported,
        )
    return spec, draft


def host_code_bytes(loaded: LoadedModel) -> int:
    """Bytes of the stored codes the loader kept for the CPU path (outside MLX's memory counters)."""
    return sum(c.nbytes for c in loaded.codes.values())


def build_proposer(
    spec: SpeculativeConfig | None,
    config: EngineConfig,
    loaded: LoadedModel,
    platform: Platform,
    num_blocks: int,
    draft: LoadedModel | None,
) -> Proposer | None:
    """The drafter of `spec` (None: no speculation); `draft`: the draft model of method draft_model."""
    if spec is None or draft is None:
        return make_proposer(spec)
    vocab = int(loaded.model.args.vocab_size)
    attention = config.attention_backend
    return build_draft_proposer(
        draft,
        vocab,
        platform,
        attention,
        config.block_size,
        num_blocks,
        spec.num_speculative_tokens,
        config.kv_cache_dtype,
    )


def speculation_for(config: EngineConfig, groups: list[LayerGroupSpec]) -> SpeculativeConfig | None:
    """The speculative config in force: off (with a start-up line) for a model with recurrent layers,
    whose states cannot roll back rejected drafts yet. Sliding windows can: a rollback never goes behind
    the point the step was scheduled from, and a window group frees only blocks behind that point."""
    spec = config.speculative_config
    if spec is None:
        return None
    if any(isinstance(g, RecurrentState) for g in groups):
        logger.warning("speculative decoding: off, this model's recurrent states cannot roll back drafts yet")
        return None
    how = f"n-grams of {spec.prompt_lookup_min}..{spec.prompt_lookup_max}" if spec.method == "ngram" else spec.model
    logger.info("speculative decoding: %s, %d tokens per step (%s)", spec.method, spec.num_speculative_tokens, how)
    return spec


def vision_parts(loaded: LoadedModel, model: PagedModel, dtype: mx.Dtype) -> dict[str, Any]:
    """The runner's vision tower and M-RoPE merge size for a vision-language model; {} for a text model."""
    if loaded.vision is None or not model.family.vision:
        return {}
    from metalserve.executor.encoders.vision import vision_tower_for

    merge = loaded.vision.config.vision_config.spatial_merge_size if model.family.mrope else None
    logger.info("vision: %s's tower on the engine thread; images in", loaded.model_type)
    return {"encoder": vision_tower_for(loaded.vision, dtype), "mrope_merge_size": merge}


# A warm-up step's length when --kv-cache-memory sizes the pool: long enough to take the prefill route,
# whose kernels (numba's on the CPU path) then compile or load at start-up, not in the first request.
COMPILE_WARMUP_TOKENS = 64


def warm_up_step(
    model: PagedModel,
    spec: KVCacheSpec,
    config: EngineConfig,
    attention: AttentionBackend[Any, Any],
    tokens: int | None = None,
) -> int:
    """Run one prefill of `tokens` (default max_num_batched_tokens) on a throw-away pool and return MLX's
    peak memory. The first step also compiles the kernels it runs: on a fresh numba cache (a new install or
    upgrade) that took 46 s of the coder 0.5B's first request."""
    n = config.max_num_batched_tokens if tokens is None else min(tokens, config.max_num_batched_tokens)
    blocks = -(-n // config.block_size)
    mx.reset_peak_memory()
    runner = ModelRunner(model, spec.with_blocks(blocks), sampler=Sampler(0), backend=attention)
    params = SamplingParams(temperature=0, max_tokens=1)
    # Every group's table over the same throw-away blocks: the values written are never read back.
    tables = tuple(list(range(blocks)) for _ in spec.groups)
    new = NewRequestData("warmup", [0] * n, n, params, tables, 0)
    runner.execute_model(SchedulerOutput([new], [], {"warmup": n}, n))
    peak = mx.get_peak_memory()
    del runner
    mx.clear_cache()
    return_freed_memory()  # the step's activations, freed (93 MB of the coder 0.5B's resident set at start)
    return int(peak)
