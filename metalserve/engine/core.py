"""The engine core: schedule -> execute -> update, one step at a time, no asyncio inside. Built by
serving/build.py (one model) or serving/pipeline.py (pipeline stages)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import mlx.core as mx

from metalserve.executor.encoder_runner import EncoderRunner
from metalserve.executor.runner import InFlightStep, ModelRunner
from metalserve.lora.files import AdapterError, read_adapter
from metalserve.lora.request import LoraRequest
from metalserve.outputs import EngineCoreOutput
from metalserve.platform import Platform, current_platform, return_freed_memory
from metalserve.pooling_params import PoolingModel
from metalserve.request import Request, RequestStatus
from metalserve.scheduler.output import SchedulerOutput
from metalserve.scheduler.scheduler import Scheduler, SchedulerStats

logger = logging.getLogger("metalserve.engine")

GRAMMAR_POLL_S = 0.002


class WrongThreadError(RuntimeError):
    """A core stepped on another thread than the one that built it."""


class EngineCore:
    """Owns the scheduler (with its KV manager) and the model runner."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner | EncoderRunner,
        max_model_len: int,
        platform: Platform | None = None,
        async_scheduling: bool = False,
        *,
        weight_bytes: int = 0,
        kv_bytes_per_block: int = 0,
        kv_pool_bytes: int = 0,
        pooling: PoolingModel | None = None,
    ) -> None:
        """`async_scheduling`: schedule step k+1 while step k computes (see `_step_ahead`). The sizes are
        what the builder measured and planned, for the models' memory budget and /debug/memory. `pooling`: a
        pooling model's defaults (None: a generating model); it then takes pooling requests only."""
        self.pooling = pooling
        runner.pooling_model = pooling is not None
        self.scheduler = scheduler
        self.runner = runner
        self.max_model_len = max_model_len
        self.platform = current_platform() if platform is None else platform
        self.async_scheduling = async_scheduling
        scheduler.lookahead = async_scheduling
        self._in_flight: tuple[SchedulerOutput, InFlightStep] | None = None
        # MLX arrays belong to the thread that made them (engine_thread.py): steps run where the core was built.
        self.owner_thread = threading.get_ident()
        self.kv_pool_bytes = kv_pool_bytes  # the pool at its largest
        self.weight_bytes = weight_bytes  # measured at load: the model's parameters plus host-side codes
        self.kv_bytes_per_block = kv_bytes_per_block

    def release_idle_memory(self) -> None:
        """Nothing is running: hand MLX's buffer cache (the activations of the largest step so far) and
        the allocator's freed heap back to the OS, so the resident set falls at idle instead of staying at
        the peak of the last burst. The next step allocates afresh."""
        mx.clear_cache()
        return_freed_memory()

    def memory_report(self) -> dict[str, int]:
        """Bytes by component: the weights (fixed at load), the KV pool as grown so far, and MLX's buffer
        cache (the process's: freed arrays kept for reuse)."""
        pool = len(self.scheduler.kv.pool.blocks) * self.kv_bytes_per_block
        return {"weights": self.weight_bytes, "kv_pool": pool, "mlx_cache": int(mx.get_cache_memory())}

    def add_request(self, request: Request) -> None:
        if request.mm_inputs and self.runner.encoder_outputs is None:
            raise ValueError("this model takes no images")
        if request.lora is not None and replace(request.lora, scale=1.0) not in self.lora_requests().values():
            raise ValueError(f"LoRA adapter {request.lora.name!r} is not loaded")
        if request.sampling_params.pooling is not None and not self.runner.pooling_model:
            # A pooling model's steps pack both kinds (the APIs send it pooling requests only).
            raise ValueError("this model generates text: it was not started as a pooling model (--runner pooling)")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens, more than max_model_len={self.max_model_len}"
            )
        self.scheduler.add_request(request)

    def lora_requests(self) -> dict[str, LoraRequest]:
        """The loaded LoRA adapters by name (empty without --enable-lora)."""
        lora = self.runner.lora
        if lora is None:
            return {}
        return {name: LoraRequest(name, adapter.key, adapter.path) for name, adapter in list(lora.adapters.items())}

    def load_lora(self, name: str, path: str) -> LoraRequest:
        """Read and load an adapter at run time (on the engine thread, between steps); AdapterError (a
        ValueError) when LoRA is off, the name is taken, the slots are full or it does not fit the model."""
        lora = self.runner.lora
        if lora is None:
            raise AdapterError("LoRA adapters are off: start the server with --enable-lora")
        if name in lora.slots:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded")
        adapter = read_adapter(name, path, lora.max_rank)
        lora.load(adapter)
        logger.info("LoRA adapter %s loaded from %s: rank %d, %d bytes", name, path, adapter.rank, adapter.nbytes)
        return self.lora_requests()[name]

    def unload_lora(self, name: str) -> None:
        """Unload an adapter no running or waiting request uses; AdapterError otherwise."""
        lora = self.runner.lora
        if lora is None or name not in lora.slots:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded")
        users = sum(1 for r in self.scheduler.requests.values() if r.lora is not None and r.lora.name == name)
        if users:
            raise AdapterError(f"LoRA adapter {name!r} has {users} requests in flight: unload it once they end")
        lora.unload(name)
        logger.info("LoRA adapter %s unloaded", name)

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
