"""The engine core: schedule -> execute -> update, one step at a time, no asyncio inside."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from metalserve.config import ConfigError, EngineConfig
from metalserve.engine.kv_disk import attach_disk_tier
from metalserve.engine.kv_groups import build_scheduler, state_group
from metalserve.engine.kv_plan import plan_kv_pool
from metalserve.executor.attention.base import AttentionBackend
from metalserve.executor.attention.select import select_attention
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.models.families import check_supported, kv_cache_spec
from metalserve.executor.runner import InFlightStep, ModelRunner
from metalserve.executor.sampler import Sampler
from metalserve.kvcache.specs import KVCacheSpec, LayerGroupSpec, RecurrentState
from metalserve.loader import LoadedModel, load_model
from metalserve.outputs import EngineCoreOutput
from metalserve.platform import Platform, current_platform
from metalserve.request import Request, RequestStatus
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import NewRequestData, SchedulerOutput
from metalserve.scheduler.scheduler import Scheduler, SchedulerStats
from metalserve.spec_decode.draft_model import build_draft_proposer
from metalserve.spec_decode.proposer import Proposer, make_proposer
from metalserve.speculative_config import SpeculativeConfig
from metalserve.units import format_bytes

logger = logging.getLogger("metalserve.engine")

# MLX keeps freed buffers for reuse; cap that cache so memory does not creep while serving.
BUFFER_CACHE_FRACTION = 0.1
GRAMMAR_POLL_S = 0.002


class WrongThreadError(RuntimeError):
    """A core stepped on another thread than the one that built it."""


class EngineCore:
    """Owns the scheduler (with its KV manager) and the model runner."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        max_model_len: int,
        platform: Platform | None = None,
        async_scheduling: bool = False,
    ) -> None:
        """`async_scheduling`: schedule step k+1 while step k computes (see `_step_ahead`)."""
        self.scheduler = scheduler
        self.runner = runner
        self.max_model_len = max_model_len
        self.platform = current_platform() if platform is None else platform
        self.async_scheduling = async_scheduling
        scheduler.lookahead = async_scheduling
        self._in_flight: tuple[SchedulerOutput, InFlightStep] | None = None
        # MLX arrays belong to the thread that made them (engine_thread.py): steps run where the core was built.
        self.owner_thread = threading.get_ident()
        self.kv_pool_bytes = 0  # the pool at its largest (set by from_loaded), for the models' memory budget
        self.weight_bytes = 0  # measured at load: the model's parameters plus host-side codes
        self.kv_bytes_per_block = 0

    def memory_report(self) -> dict[str, int]:
        """Bytes by component: the weights (fixed at load) and the KV pool as grown so far."""
        return {"weights": self.weight_bytes, "kv_pool": len(self.scheduler.kv.pool.blocks) * self.kv_bytes_per_block}

    @classmethod
    def from_config(cls, config: EngineConfig) -> tuple[EngineCore, LoadedModel]:
        loaded = load_model(
            config.model,
            weights=config.weights,
            dequantize_max_bytes=config.dequantize_max_bytes,
            chat_template=config.chat_template,
            hf_overrides=config.hf_overrides,
            check_model_type=check_supported,
        )
        return cls.from_loaded(config, loaded), loaded

    @classmethod
    def from_loaded(cls, config: EngineConfig, loaded: LoadedModel, draft: LoadedModel | None = None) -> EngineCore:
        """`draft`: the draft model of `--speculative-config` method draft_model, if already loaded."""
        platform = current_platform()
        max_model_len = resolve_max_model_len(config, loaded.max_model_len, loaded.rope_scaled_len, warn=True)
        model = PagedModel.from_loaded(loaded, platform)
        # This model's own parameters (MLX's active memory would count every model a server has loaded).
        weight_bytes = parameter_bytes(loaded.model) + model.host_bytes()
        storage = config.kv_cache_dtype
        try:
            spec = model.get_kv_cache_spec(model.family.page(loaded.model, storage), config.block_size)
        except ValueError as exc:  # a page format this model's shape cannot take (q4 groups)
            raise ConfigError(f"--kv-cache-dtype {storage}: {exc}") from exc
        head_dims = {t.head_dim for t in spec.tensors}
        latent = model.kv_layout.value_dim is not None
        dtype = model.family.activation_dtype(loaded.model)
        image_masks = model.family.bidirectional_images and loaded.vision is not None
        attention = select_attention(
            config.attention_backend,
            dtype,
            platform,
            head_dims,
            latent_kv=latent,
            kv_storage=spec.page.storage,
            image_masks=image_masks,
        )
        note = spec.kept_dtype_note(storage)
        if note:
            logger.info("%s", note)
        logger.info("platform: %s", platform.describe())
        logger.info("attention: %s", attention.description)
        logger.info("on the host: %s", model.host_description())
        peak = held = 0
        states = state_group(spec.groups)
        speculation, draft = draft_for(config, list(spec.groups), draft)
        if config.kv_cache_memory is None:
            # The CPU path's stored codes (the draft's too) live outside MLX's counters.
            host = model.host_bytes() + (host_code_bytes(draft) if draft is not None else 0)
            held = int(mx.get_active_memory()) + host
            peak = measure_step_peak(model, spec, config, attention, states) + host
        for g in spec.groups:
            if isinstance(g, RecurrentState):
                logger.info(
                    "recurrent state: %d layers, %s per request, a slot in every KV block (counted in its size)",
                    len(g.layers),
                    format_bytes(g.state_bytes),
                )
        draft_bytes = kv_cache_spec(draft, config.block_size, storage).bytes_per_block if draft is not None else 0
        plan = plan_kv_pool(config, spec, max_model_len, peak, held, draft_bytes)
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
            state_group=states or 1,
            proposer=build_proposer(speculation, config, loaded, platform, plan.initial_blocks, draft),
            **vision_parts(loaded, model, dtype),
            async_eval=platform.metal,
        )
        attach_disk_tier(config, loaded, spec, scheduler, runner)
        mx.set_cache_limit(int(BUFFER_CACHE_FRACTION * plan.num_blocks * spec.bytes_per_block))
        core = cls(
            scheduler, runner, max_model_len, platform, async_scheduling_for(config, speculation, platform.metal)
        )
        core.weight_bytes, core.kv_bytes_per_block = weight_bytes, spec.bytes_per_block
        core.kv_pool_bytes = plan.num_blocks * spec.bytes_per_block
        return core

    def add_request(self, request: Request) -> None:
        if request.mm_inputs and self.runner.encoder_outputs is None:
            raise ValueError("this model takes no images")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens, more than max_model_len={self.max_model_len}"
            )
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def finish_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def step(self) -> list[EngineCoreOutput]:
        self.check_thread()
        if self.async_scheduling:
            return self._step_ahead()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and (self.scheduler.num_waiting_for_grammar or self.scheduler.num_waiting_for_kv):
            time.sleep(GRAMMAR_POLL_S)  # only compiling grammars or loading blocks wait: give their threads the CPU
        runner_output = self.runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_ahead(self) -> list[EngineCoreOutput]:
        """Async scheduling, as vLLM V1's: step k+1 is scheduled while step k computes (requests whose
        token k is still being sampled get a placeholder, scheduler.py), launched as soon as k's tokens
        are in, and k's outputs are made (and detokenized by the caller) while k+1 computes. Returns
        step k's outputs. A step with a structured-output request runs in order: its grammar must take
        token k before anything is scheduled after it."""
        outputs: list[EngineCoreOutput] = []
        previous, self._in_flight = self._in_flight, None
        if previous is not None and self._has_structured():
            outputs += self.scheduler.update_from_output(previous[0], self.runner.finish(previous[1]))
            previous = None
        so = self.scheduler.schedule()
        if so.is_empty and (self.scheduler.num_waiting_for_grammar or self.scheduler.num_waiting_for_kv):
            time.sleep(GRAMMAR_POLL_S)
        result = self.runner.finish(previous[1]) if previous is not None else None
        if so.total_num_scheduled_tokens:
            self._in_flight = (so, self.runner.launch(so))  # step k+1 computes from here on ...
        if previous is not None and result is not None:
            outputs += self.scheduler.update_from_output(previous[0], result)  # ... while k's outputs are made
        if not so.total_num_scheduled_tokens:
            outputs += self.scheduler.update_from_output(so, self.runner.execute_model(so))
        return outputs

    def _has_structured(self) -> bool:
        return any(r.structured is not None for r in self.scheduler.requests.values())

    def check_thread(self) -> None:
        """Refuse a step on another thread than the one that built the core: the model's lazy arrays
        (RoPE tables, pools) were made on that thread's stream and cannot be evaluated here."""
        if threading.get_ident() != self.owner_thread:
            raise WrongThreadError(
                f"the engine core was built on thread {self.owner_thread} and stepped on "
                f"{threading.get_ident()}; build it on the thread that runs its steps (EngineThread.call)"
            )

    def has_unfinished_requests(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def close(self) -> None:
        """Finish the KV connector's queued saves and stop its threads."""
        if self.runner.connector is not None:
            self.runner.connector.close()


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


def parameter_bytes(model: Any) -> int:
    """Bytes of an MLX module's parameters."""
    leaves: Any = tree_flatten(model.parameters())  # [(path, array)]
    return sum(int(array.nbytes) for _, array in leaves)


def host_code_bytes(loaded: LoadedModel) -> int:
    """Bytes of the stored codes the loader kept for the CPU path (outside MLX's memory counters)."""
    return sum(c.codes.nbytes + c.scales.nbytes + c.biases.nbytes for c in loaded.codes.values())


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


def resolve_max_model_len(
    config: EngineConfig, model_len: int, scaled_len: int | None = None, *, warn: bool = False
) -> int:
    """The context to serve: --max-model-len, else the model's trained context (`model_len`). Longer than
    that only with --allow-long-max-model-len; `scaled_len` is what a RoPE scaling from --hf-overrides
    covers, and `warn` logs the start-up warning for a context past the trained one."""
    wanted = config.max_model_len
    if wanted is None:
        if scaled_len is not None and scaled_len > model_len and warn:
            logger.info(
                "RoPE scaling covers %d tokens; pass --max-model-len (and --allow-long-max-model-len) "
                "to serve more than the trained %d",
                scaled_len,
                model_len,
            )
        return model_len
    if wanted <= model_len:
        return wanted
    if not config.allow_long_max_model_len:
        hint = (
            f"RoPE scaling from --hf-overrides covers {scaled_len} tokens"
            if scaled_len is not None
            else 'a RoPE scaling stretches it, e.g. --hf-overrides \'{"rope_scaling": {"rope_type": "linear", '
            '"factor": 4.0}}\''
        )
        raise ConfigError(
            f"--max-model-len {wanted} is longer than the model's trained context ({model_len} tokens); add "
            f"--allow-long-max-model-len to serve it anyway ({hint})"
        )
    if warn:
        if scaled_len is not None and wanted <= scaled_len:
            logger.warning(
                "--max-model-len %d is past the trained context (%d tokens), within what the RoPE scaling "
                "covers (%d): expect some loss of quality",
                wanted,
                model_len,
                scaled_len,
            )
        else:
            logger.warning(
                "--max-model-len %d is past the trained context (%d tokens) and past what any RoPE "
                "scaling covers: positions beyond %d were never trained, expect degraded output",
                wanted,
                model_len,
                scaled_len or model_len,
            )
    return wanted


def measure_step_peak(
    model: PagedModel,
    spec: KVCacheSpec,
    config: EngineConfig,
    attention: AttentionBackend[Any, Any],
    states: int = 0,
) -> int:
    """Run one prefill of max_num_batched_tokens tokens on a throw-away pool and return MLX's peak memory.
    `states`: the recurrent-state group's index (hybrid models; 0: none)."""
    n = config.max_num_batched_tokens
    blocks = -(-n // config.block_size)
    mx.reset_peak_memory()
    runner = ModelRunner(
        model, spec.with_blocks(blocks), sampler=Sampler(0), backend=attention, state_group=states or 1
    )
    params = SamplingParams(temperature=0, max_tokens=1)
    # Every group's table over the same throw-away blocks: the values written are never read back.
    tables = tuple(list(range(blocks)) for _ in range(runner.num_tables + 1))
    new = NewRequestData("warmup", [0] * n, n, params, tables, 0)
    runner.execute_model(SchedulerOutput([new], [], {"warmup": n}, n))
    peak = mx.get_peak_memory()
    del runner
    mx.clear_cache()
    return int(peak)
