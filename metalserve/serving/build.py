"""One model's engine, built in one place: config -> loaded model -> KV spec -> pool plan -> scheduler +
runner + connector -> EngineCore (and, for the server, its AsyncEngine on its engine thread). `generate`,
the server, the registry's model threads and the benchmarks all build here."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from metalserve.config import ConfigError, EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.executor.attention.base import AttentionBackend
from metalserve.executor.attention.select import select_attention
from metalserve.executor.host import host_compute_applies, paged_model
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.models.families import kv_cache_spec, load_model_for
from metalserve.executor.runner import ModelRunner
from metalserve.executor.sampler import Sampler
from metalserve.kvcache.plan import plan_kv_pool, pool_budget
from metalserve.kvcache.specs import KVCacheSpec, LayerGroupSpec, RecurrentState
from metalserve.loader import LoadedModel
from metalserve.loader.codes_linear import CodesLinear
from metalserve.loader.weights_mode import parameter_bytes
from metalserve.lora.layers import LoraSlots
from metalserve.platform import Platform, current_platform
from metalserve.pooling_params import PoolingModel
from metalserve.scheduler.scheduler import Scheduler
from metalserve.serving.context_len import resolve_max_model_len
from metalserve.serving.kv_disk import attach_disk_tier
from metalserve.serving.kv_groups import build_scheduler
from metalserve.serving.lora import prepare_fast_path_lora, prepare_lora
from metalserve.serving.memory import machine_memory
from metalserve.serving.parts import (
    COMPILE_WARMUP_TOKENS,
    async_scheduling_for,
    build_proposer,
    draft_for,
    host_code_bytes,
    vision_parts,
    warm_up_step,
)
from metalserve.serving.pooling import pooling_model_of, reranker_of
from metalserve.units import format_bytes

logger = logging.getLogger("metalserve.engine")

# MLX keeps freed buffers for reuse; cap that cache so memory does not creep while serving.
BUFFER_CACHE_FRACTION = 0.1


def rank0_scheduler(
    config: EngineConfig, spec: KVCacheSpec, num_blocks: int, max_model_len: int, initial_blocks: int
) -> Scheduler:
    """Rank 0's one scheduler over a distributed pool (pipeline or tensor parallel), with MLX's buffer cache
    capped as the one-process engine caps it."""
    mx.set_cache_limit(int(BUFFER_CACHE_FRACTION * num_blocks * spec.bytes_per_block))
    return build_scheduler(config, spec, num_blocks, max_model_len, initial_blocks)


def load_engine_core(config: EngineConfig) -> tuple[EngineCore, LoadedModel]:
    """Load the config's model and build its core (on the thread that will step it)."""
    from metalserve.serving.encoder import build_encoder_core, encoder_model_type, load_encoder

    if encoder_model_type(config.model) is not None:  # BERT family: through mlx-embeddings' classes
        loaded = load_encoder(config)
        return build_encoder_core(config, loaded), loaded
    loaded = load_model_for(config)
    return build_engine_core(config, loaded), loaded


def build_engine_core(config: EngineConfig, loaded: LoadedModel, draft: LoadedModel | None = None) -> EngineCore:
    """The engine core of a loaded model. `draft`: the draft model of `--speculative-config` method
    draft_model, if already loaded."""
    platform = current_platform()
    max_model_len = resolve_max_model_len(config, loaded.max_model_len, loaded.rope_scaled_len, warn=True)
    model, pooling, lora = _paged_model_for(config, loaded, platform)
    # This model's own parameters (MLX's active memory would count every model a server has loaded).
    weight_bytes = parameter_bytes(loaded.model) + model.host_bytes() + (lora.detached_bytes if lora else 0)
    storage = config.kv_cache_dtype
    try:
        spec = model.get_kv_cache_spec(model.family.page(loaded.model, storage), config.block_size)
    except ValueError as exc:  # a page format this model's shape cannot take (q4 groups)
        raise ConfigError(f"--kv-cache-dtype {storage}: {exc}") from exc
    dtype = model.family.activation_dtype(loaded.model)
    attention = _attention_for(config, model, spec, loaded, platform, dtype)
    note = spec.kept_dtype_note(storage)
    if note:
        logger.info("%s", note)
    logger.info("platform: %s", platform.describe())
    logger.info("attention: %s", attention.description)
    logger.info("on the host: %s", model.host_description())
    speculation, draft = draft_for(config, list(spec.groups), draft)
    memory, peak = None, 0
    if config.kv_cache_memory is None:
        # The CPU path's stored codes (the draft's too) live outside MLX's counters.
        host = model.host_bytes() + (host_code_bytes(draft) if draft is not None else 0)
        held = int(mx.get_active_memory()) + host
        peak = warm_up_step(model, spec, config, attention) + host
        memory = machine_memory(held)
    else:  # the pool's size is given: a short step, for the kernels' sake only
        warm_up_step(model, spec, config, attention, COMPILE_WARMUP_TOKENS)
    _log_states(spec.groups)
    draft_bytes = kv_cache_spec(draft, config.block_size, storage).bytes_per_block if draft is not None else 0
    plan = plan_kv_pool(config, spec, max_model_len, pool_budget(config, memory, peak), draft_bytes)
    spec = spec.with_blocks(plan.initial_blocks)
    scheduler = build_scheduler(
        config,
        spec,
        plan.num_blocks,
        max_model_len,
        plan.initial_blocks,
        mm_splittable=not model.family.bidirectional_images,
    )
    runner = ModelRunner(
        model,
        spec,
        eos_token_ids=loaded.eos_token_ids,
        sampler=Sampler(config.seed),
        backend=attention,
        proposer=build_proposer(speculation, config, loaded, platform, plan.initial_blocks, draft),
        **vision_parts(loaded, model, dtype),
        async_eval=platform.metal,
    )
    runner.lora = lora
    attach_disk_tier(config, loaded, spec, scheduler, runner)
    mx.set_cache_limit(int(BUFFER_CACHE_FRACTION * plan.num_blocks * spec.bytes_per_block))
    return EngineCore(
        scheduler,
        runner,
        max_model_len,
        platform,
        async_scheduling_for(config, speculation, platform.metal),
        weight_bytes=weight_bytes,
        kv_bytes_per_block=spec.bytes_per_block,
        kv_pool_bytes=plan.num_blocks * spec.bytes_per_block,
        pooling=pooling,
    )


def _paged_model_for(
    config: EngineConfig, loaded: LoadedModel, platform: Platform
) -> tuple[PagedModel, PoolingModel | None, LoraSlots | None]:
    """The paged model, with the pooling setup and LoRA slots it needs. Pooling runs on the all-MLX route
    (pooled rows need the hidden states); adapters run on the CPU fast path where the model takes it
    (lora/fused.py), else on the MLX route (lora/layers.py)."""
    try:
        pooling = pooling_model_of(config, loaded.source, int(loaded.config.get("hidden_size", 0)))
        if pooling is not None:
            pooling = reranker_of(pooling, config.hf_overrides, loaded.tokenizer)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if pooling is not None and config.enable_lora:
        raise ConfigError(
            "--enable-lora serves generating models; a pooling model (--runner pooling) takes no adapters"
        )
    if pooling is None and config.enable_lora and _takes_host_decoder(loaded, platform):
        model = paged_model(loaded, platform)
        return model, None, prepare_fast_path_lora(config, model)
    lora = prepare_lora(config, loaded.model, loaded.model_type)
    if pooling is None and lora is None:
        return paged_model(loaded, platform), None, None
    if pooling is not None:
        logger.info("pooling model: %s pooling%s", pooling.pooling_type, ", normalised" if pooling.normalize else "")
    loaded.codes.clear()
    return PagedModel(loaded.model, loaded.model_type), pooling, lora


def _takes_host_decoder(loaded: LoadedModel, platform: Platform) -> bool:
    """Whether the host compute will run this model's decoder in numba: it needs the projections' codes.
    Without them LoRA takes the MLX route's own layers (separate q/k/v, each delta one gathered pair of
    matmuls), which ran mixed steps faster than the fused stacks on MLX (bench/lora_bench.py)."""
    if not host_compute_applies(platform, loaded.model_type):
        return False
    return bool(loaded.codes) or any(isinstance(m, CodesLinear) for _, m in loaded.model.named_modules())


def _attention_for(
    config: EngineConfig, model: PagedModel, spec: KVCacheSpec, loaded: LoadedModel, platform: Platform, dtype: mx.Dtype
) -> AttentionBackend[Any, Any]:
    """The attention backend, chosen once from the flag, the platform, the dtype and the pages."""
    return select_attention(
        config.attention_backend,
        dtype,
        platform,
        {t.head_dim for t in spec.tensors},
        latent_kv=model.kv_layout.value_dim is not None,
        kv_storage=spec.page.storage,
        image_masks=model.family.bidirectional_images and loaded.vision is not None,
    )


def _log_states(groups: Sequence[LayerGroupSpec]) -> None:
    for g in groups:
        if isinstance(g, RecurrentState):
            logger.info(
                "recurrent state: %d layers, %s per request, a slot in every KV block (counted in its size)",
                len(g.layers),
                format_bytes(g.state_bytes),
            )
