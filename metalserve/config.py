"""One frozen EngineConfig and its validation; the CLI maps flags onto it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from metalserve.spec_decode.config import SpeculativeConfig

SchedulingPolicy = Literal["fcfs", "priority"]
WeightsMode = Literal["auto", "dequantize", "quantized"]
# --attention-backend: "mlx" is the MLX-ops backend; "reference", its old name, is a deprecated alias.
AttentionBackendName = Literal["auto", "metal", "cpu", "mlx", "reference"]
ATTENTION_BACKEND_NAMES: tuple[str, ...] = ("auto", "metal", "cpu", "mlx", "reference")


# `metalserve serve`'s token budget where MLX runs on the CPU: steps of up to 512 tokens run on the host
# (executor/host/forward.py), and smaller steps let new prompts start sooner. At concurrency 8
# (bench/compare_peers.py) mean TTFT was 4.4 s at 512 against 7.6 s at 2048, at the same output tok/s.
CPU_MAX_NUM_BATCHED_TOKENS = 512


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the flag to change."""


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default model
    served_model_name: str | None = None
    max_model_len: int | None = None  # None: the model's own context length
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # 0: off; else the most tokens one prefill chunk may take
    enable_prefix_caching: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    gpu_memory_utilization: float = 0.5
    kv_cache_memory: int | None = None  # bytes; overrides gpu_memory_utilization
    weights: WeightsMode = "auto"
    dequantize_max_bytes: int = 4 * 1024**3  # "auto": dequantize to fp32 only below this size
    attention_backend: AttentionBackendName = "auto"
    chat_template: str | None = None
    tool_call_parser: str | None = None
    seed: int = 0
    pipeline_parallel_size: int = 1  # ranks, each holding a slice of the layers (metalserve/distributed/)
    pipeline_layer_partition: tuple[int, ...] | None = None  # layers per rank; None: balanced by bytes
    pipeline_step_timeout: float = 120.0  # seconds without a step's result before the server gives up
    speculative_config: SpeculativeConfig | None = None  # --speculative-config; None: no speculation
    # Schedule and prepare step k+1 while step k computes (vLLM's --async-scheduling; engine/core.py).
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.block_size not in (8, 16, 32):
            raise ConfigError(f"--block-size must be 8, 16 or 32, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError("--max-num-seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-batched-tokens must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("--max-model-len must be at least 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("--kv-cache-memory must be a positive number of bytes")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("--long-prefill-token-threshold must be >= 0")
        if self.pipeline_parallel_size < 1:
            raise ConfigError("--pipeline-parallel-size must be at least 1")
        if self.pipeline_step_timeout <= 0:
            raise ConfigError("--pipeline-step-timeout must be a positive number of seconds")
        partition = self.pipeline_layer_partition
        if partition is not None and len(partition) != self.pipeline_parallel_size:
            raise ConfigError(
                f"--pipeline-layer-partition gives {len(partition)} counts for "
                f"--pipeline-parallel-size {self.pipeline_parallel_size}"
            )
        if self.pipeline_parallel_size > 1 and self.speculative_config is not None:
            # Pipeline stages run one step's tokens and return no drafts: say so rather than not speculate.
            raise ConfigError("--speculative-config does not work with --pipeline-parallel-size > 1 yet")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError("--scheduling-policy must be 'fcfs' or 'priority'")
