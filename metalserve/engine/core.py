"""The engine core: schedule -> execute -> update, one step at a time, no asyncio inside."""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from dataclasses import dataclass

import mlx.core as mx

from metalserve.config import ConfigError, EngineConfig
from metalserve.engine.kv_groups import build_scheduler
from metalserve.engine.kv_plan import plan_kv_pool
from metalserve.executor.context import AttentionFn
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.runner import KVCacheSpec, ModelRunner
from metalserve.executor.sampler import Sampler
from metalserve.loader import LoadedModel, load_model
from metalserve.outputs import EngineCoreOutput
from metalserve.request import Request, RequestStatus
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import NewRequestData, SchedulerOutput
from metalserve.scheduler.scheduler import Scheduler, SchedulerStats

logger = logging.getLogger("metalserve.engine")

# MLX keeps freed buffers for reuse; cap that cache so memory does not creep while serving.
BUFFER_CACHE_FRACTION = 0.1
GRAMMAR_POLL_S = 0.002


class EngineCore:
    """Owns the scheduler (with its KV manager) and the model runner."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, max_model_len: int) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.max_model_len = max_model_len
        self._stream_thread = threading.get_ident()

    @classmethod
    def from_config(cls, config: EngineConfig) -> tuple[EngineCore, LoadedModel]:
        loaded = load_model(
            config.model,
            weights=config.weights,
            dequantize_max_bytes=config.dequantize_max_bytes,
            chat_template=config.chat_template,
        )
        return cls.from_loaded(config, loaded), loaded

    @classmethod
    def from_loaded(cls, config: EngineConfig, loaded: LoadedModel) -> EngineCore:
        max_model_len = resolve_max_model_len(config, loaded.max_model_len)
        model = PagedModel(loaded.model, loaded.model_type)
        attention = select_attention(config.attention_backend, loaded.dtype)
        logger.info("attention: %s", attention.description)
        logger.info("on the host: %s", model.host_description())
        peak = held = 0
        if config.kv_cache_memory is None:
            host = model.host_bytes()  # the CPU path's stored codes live outside MLX's counters
            held = int(mx.get_active_memory()) + host
            peak = measure_step_peak(model, loaded, config, attention) + host
        plan = plan_kv_pool(config, loaded, max_model_len, peak, held)
        spec = KVCacheSpec.for_model(loaded, config.block_size, plan.initial_blocks)
        runner = ModelRunner(
            model,
            spec,
            eos_token_ids=loaded.eos_token_ids,
            sampler=Sampler(config.seed),
            attention_fn=attention.fn,
            cpu_attention=attention.cpu,
        )
        mx.set_cache_limit(int(BUFFER_CACHE_FRACTION * plan.num_blocks * spec.bytes_per_block))
        scheduler = build_scheduler(config, loaded, plan.num_blocks, max_model_len, plan.initial_blocks)
        return cls(scheduler, runner, max_model_len)

    def add_request(self, request: Request) -> None:
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
        self._ensure_stream()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and self.scheduler.num_waiting_for_grammar:
            time.sleep(GRAMMAR_POLL_S)  # only compiling grammars wait: give their thread the CPU
        runner_output = self.runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _ensure_stream(self) -> None:
        """MLX streams belong to a thread: the first step on a new thread (the async engine's) makes one."""
        if threading.get_ident() != self._stream_thread:
            mx.set_default_stream(mx.new_stream(mx.default_device()))
            self._stream_thread = threading.get_ident()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()


def resolve_max_model_len(config: EngineConfig, model_len: int) -> int:
    if config.max_model_len is None:
        return model_len
    if config.max_model_len > model_len:
        raise ConfigError(
            f"--max-model-len {config.max_model_len} is longer than the model's context ({model_len} tokens)"
        )
    return config.max_model_len


@dataclass(frozen=True)
class AttentionChoice:
    """How the runner attends: a kernel with the contract signature, or the portable pool (fn None),
    attended by the numba CPU kernel when `cpu`."""

    fn: AttentionFn | None
    cpu: bool
    description: str


PORTABLE = AttentionChoice(None, False, "portable MLX path (metalserve/kernels/reference.py)")
CPU = AttentionChoice(None, True, "CPU path: the numba kernel (metalserve/kernels/cpu_attention.py)")


def select_attention(backend: str, dtype: mx.Dtype) -> AttentionChoice:
    """`auto`: the Metal kernel where Metal exists, else the CPU path for float32 KV, else the portable path."""
    if backend == "reference":
        return PORTABLE
    if backend == "metal" or (backend == "auto" and mx.metal.is_available()):
        from metalserve.kernels.metal import attention_backend

        try:
            return AttentionChoice(attention_backend("metal"), False, "Metal paged-attention kernel")
        except RuntimeError as e:
            raise ConfigError(f"--attention-backend {backend}: {e}") from e
    problem = _cpu_path_problem(dtype)
    if backend == "cpu" and problem:
        raise ConfigError(f"--attention-backend cpu: {problem}")
    return PORTABLE if problem else CPU


def _cpu_path_problem(dtype: mx.Dtype) -> str | None:
    if importlib.util.find_spec("numba") is None:
        return "it needs the numba package (pip install numba)"
    if dtype != mx.float32:
        return f"it needs float32 activations and KV, and this model computes in {dtype} (see --weights)"
    return None


def measure_step_peak(model: PagedModel, loaded: LoadedModel, config: EngineConfig, attention: AttentionChoice) -> int:
    """Run one prefill of max_num_batched_tokens tokens on a throw-away pool and return MLX's peak memory."""
    n = config.max_num_batched_tokens
    blocks = -(-n // config.block_size)
    spec = KVCacheSpec.for_model(loaded, config.block_size, blocks)
    mx.reset_peak_memory()
    runner = ModelRunner(model, spec, sampler=Sampler(0), attention_fn=attention.fn, cpu_attention=attention.cpu)
    params = SamplingParams(temperature=0, max_tokens=1)
    new = NewRequestData("warmup", [0] * n, n, params, list(range(blocks)), 0)
    runner.execute_model(SchedulerOutput([new], [], {"warmup": n}, n))
    peak = mx.get_peak_memory()
    del runner
    mx.clear_cache()
    return int(peak)
