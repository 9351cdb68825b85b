"""One frozen EngineConfig and its validation; `metalserve serve`'s engine flags are its fields.

To add a flag, add one field with `flag(default, help)`: metalserve/flags.py generates the argparse
argument from it and builds the config from the parsed flags.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, get_args

from metalserve.flags import flag, option_name
from metalserve.kvcache.specs import BLOCK_SIZES, KVCacheDtype
from metalserve.platform import CPU_MAX_NUM_BATCHED_TOKENS, MAX_NUM_BATCHED_TOKENS
from metalserve.pooling_params import POOLING_TYPES, PoolingType
from metalserve.speculative_config import SpeculativeConfig


class SchedulingPolicy(StrEnum):
    """Which waiting request is admitted first (--scheduling-policy)."""

    FCFS = "fcfs"
    PRIORITY = "priority"  # the request's `priority` field, then arrival


class WeightsMode(StrEnum):
    """What the forward runs on (--weights): fp32 dequantized at load or the stored quantized weights."""

    AUTO = "auto"  # off Metal: a fast-path GGUF in its codes, else fp32 below EngineConfig.dequantize_max_bytes
    DEQUANTIZE = "dequantize"
    QUANTIZED = "quantized"


RunnerKind = Literal["auto", "generate", "pooling"]
AttentionBackendName = Literal["auto", "metal", "cpu", "mlx"]  # mlx: the MLX-ops backend
ATTENTION_BACKEND_NAMES: tuple[str, ...] = get_args(AttentionBackendName)


DEFAULT_KV_DISK_SIZE = 16 * 1024**3


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the flag to change."""


def _chat_template(value: str) -> str:
    """--chat-template: the template from a file, or given inline (anything with a Jinja brace in it)."""
    if Path(value).is_file():
        return Path(value).read_text()
    if "{" in value:
        return value
    raise ValueError(f"--chat-template: no such file {value!r}")


def _json_object(text: str) -> dict[str, Any]:
    """--hf-overrides: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--hf-overrides: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError("--hf-overrides takes a JSON object, e.g. '{\"rope_scaling\": {...}}'")
    return value


def parse_layer_partition(text: str) -> tuple[int, ...] | None:
    """--pipeline-layer-partition: `10,20` -> (10, 20); empty: None (split automatically)."""
    if text == "":
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--pipeline-layer-partition takes comma-separated layer counts, got {text!r}") from None


def _lora_modules(uses: list[list[str]]) -> tuple[tuple[str, str], ...]:
    """--lora-modules a=/path b=/other (vLLM's `name=path` form; the flag may be given more than once)."""
    modules = []
    for word in (w for words in uses for w in words):
        name, sep, path = word.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules takes name=path, got {word!r}")
        modules.append((name.strip(), path.strip()))
    return tuple(modules)


def default_token_budget() -> int:
    """The step token budget when --max-num-batched-tokens is not given: the Platform's."""
    from metalserve.platform import current_platform  # probes MLX once, on the engine's side

    return current_platform().default_token_budget()


@dataclass(frozen=True)
class EngineConfig:
    """The model, the scheduler's budgets, the KV cache, the weights and the attention backend."""

    model: str | None = flag(None, "GGUF file, model directory or hub id (default: embedded)", positional=True)
    max_model_len: int | None = flag(None, "context length (default: the model's)")
    allow_long_max_model_len: bool = flag(
        False,
        "allow --max-model-len above the model's trained context (as vLLM's "
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1), with a start-up warning; pair it with a RoPE scaling in --hf-overrides",
    )
    hf_overrides: Mapping[str, Any] | None = flag(
        None,
        'JSON merged into the model\'s config before it is built, e.g. \'{"rope_scaling": {"rope_type": '
        '"yarn", "factor": 4.0, "original_max_position_embeddings": 8192}}\' (docs/agents.md)',
        parse=_json_object,
    )
    block_size: int = flag(16, "tokens per KV cache block", choices=BLOCK_SIZES)
    max_num_seqs: int = flag(64, "most requests in one batch")
    max_num_batched_tokens: int = flag(
        MAX_NUM_BATCHED_TOKENS,
        f"token budget per step (default: {CPU_MAX_NUM_BATCHED_TOKENS} where MLX runs on the CPU, "
        f"else {MAX_NUM_BATCHED_TOKENS})",
        when_absent=default_token_budget,
    )
    long_prefill_token_threshold: int = flag(0, "the most tokens one prefill chunk may take; 0: no limit")
    max_num_encoder_input_tokens: int = flag(
        16384, "image placeholder tokens the vision tower may encode in one step (vision-language models)"
    )
    encoder_cache_size: int = flag(
        16384, "image placeholder tokens whose vision-tower outputs the encoder cache holds at once"
    )
    enable_prefix_caching: bool = flag(True, "reuse the KV blocks of prompts that share a prefix")
    scheduling_policy: SchedulingPolicy = flag(
        SchedulingPolicy.FCFS, "fcfs, or priority (the request's `priority` field)"
    )
    gpu_memory_utilization: float = flag(0.5, "fraction of the device's memory for weights and KV cache")
    kv_cache_memory: int | None = flag(None, "KV cache bytes (overrides the fraction)")
    kv_cache_dtype: KVCacheDtype = flag(
        KVCacheDtype.AUTO,
        "how K/V pages are stored: auto (the model's dtype), int8 (a scale per token and head), q4 "
        "(4-bit groups with a scale and bias each) or k8v4 (int8 keys, q4 values; MLX ops, CPU path); "
        "about 2x / 3.5x / 2.4x the tokens of fp16 in the same memory",
    )
    weights: WeightsMode = flag(WeightsMode.AUTO, "quantized weights: keep them packed, or dequantize (auto: by size)")
    dequantize_max_bytes: int = 4 * 1024**3  # "auto": dequantize to fp32 only below this size
    attention_backend: AttentionBackendName = flag(
        "auto", "auto, metal (the Metal kernel), cpu (the numba kernel) or mlx (MLX ops)"
    )
    chat_template: str | None = flag(None, "a Jinja chat template, or a file holding one", parse=_chat_template)
    tool_call_parser: str | None = None  # the flag is ServerSettings' (api/settings.py)
    runner: RunnerKind = flag(
        "auto",
        "generate, or pooling: embeddings, score and rerank only (vLLM's --runner); auto: pooling for a "
        "sentence-transformers model (modules.json) or an encoder (BERT family), else generate",
    )
    pooling_type: PoolingType | None = flag(
        None, "a pooling model's pooling: last, mean or cls (default: its sentence-transformers config, else last)"
    )
    seed: int = flag(0, "seeds the random stream that requests without a seed draw from")
    pipeline_parallel_size: int = flag(
        1,
        "split the layers over N ranks (MLX distributed); alone it starts N-1 local ranks, under "
        "mlx.launch each host runs one rank and rank 0 serves HTTP",
        aliases=("-pp",),
    )
    tensor_parallel_size: int = flag(
        1,
        "split every layer's heads and MLP columns over N ranks (MLX distributed), one all-reduce after "
        "attention and one after the MLP; alone it starts N-1 local ranks, under mlx.launch each host runs one",
        aliases=("-tp",),
    )
    pipeline_layer_partition: tuple[int, ...] | None = flag(
        None,
        "layers per rank, comma-separated (e.g. 12,18); default: balanced by weight bytes",
        parse=parse_layer_partition,
    )
    pipeline_step_timeout: float = flag(
        120.0, "seconds to wait for a step's result from the last rank before failing open requests and exiting"
    )
    speculative_config: SpeculativeConfig | None = flag(
        None,
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}',
        parse=SpeculativeConfig.from_json,
    )
    kv_disk_dir: str | None = flag(
        None, "a directory of KV blocks that outlives memory pressure and restarts (docs/disk-tier.md); default: off"
    )
    kv_disk_size: int | None = flag(None, "bytes --kv-disk-dir may hold, least recently used blocks go first (16 GiB)")
    async_scheduling: bool | None = flag(
        None,
        "schedule and prepare the next step while this one computes (vLLM's --async-scheduling); default: on "
        "with Metal, off on MLX's CPU backend (where the forward shares the cores and it measured slower); "
        "speculative decoding, pipeline stages and the KV disk tier turn it off with a start-up line",
    )

    enable_lora: bool = flag(False, "serve LoRA adapters over this model, chosen per request by `model` (docs/lora.md)")
    lora_modules: tuple[tuple[str, str], ...] = flag(
        (),
        "adapters to load at start-up, `name=path` each (an mlx-lm or PEFT adapter directory)",
        parse=_lora_modules,
        repeated=True,
    )
    max_loras: int = flag(4, "most LoRA adapters loaded at once (--enable-lora)")
    max_lora_rank: int = flag(16, "the largest LoRA rank an adapter may have (--enable-lora)")

    def __post_init__(self) -> None:
        # A plain string names an enum value too (a models file, a test): hold the member from here on.
        self._as_enum("scheduling_policy", SchedulingPolicy)
        self._as_enum("kv_cache_dtype", KVCacheDtype)
        self._as_enum("weights", WeightsMode)
        self.validate()

    def _as_enum(self, name: str, enum: type[StrEnum]) -> None:
        value = getattr(self, name)
        try:
            object.__setattr__(self, name, enum(value))
        except ValueError:
            choices = ", ".join(enum)
            raise ConfigError(f"{option_name(name)} must be one of {choices}, got {value!r}") from None

    def validate(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            sizes = ", ".join(map(str, BLOCK_SIZES[:-1])) + f" or {BLOCK_SIZES[-1]}"
            raise ConfigError(f"--block-size must be {sizes}, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError("--max-num-seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-batched-tokens must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("--max-model-len must be at least 1")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, Mapping):
            raise ConfigError("--hf-overrides takes a JSON object, e.g. '{\"rope_scaling\": {...}}'")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("--kv-cache-memory must be a positive number of bytes")
        if self.max_num_encoder_input_tokens < 1 or self.encoder_cache_size < 1:
            raise ConfigError("--max-num-encoder-input-tokens and --encoder-cache-size must be at least 1")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("--long-prefill-token-threshold must be >= 0")
        if self.pipeline_parallel_size < 1:
            raise ConfigError("--pipeline-parallel-size must be at least 1")
        self._validate_tensor_parallel()
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
        if self.attention_backend not in ATTENTION_BACKEND_NAMES:
            names = ", ".join(ATTENTION_BACKEND_NAMES)
            raise ConfigError(f"--attention-backend must be one of {names}, got {self.attention_backend!r}")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ConfigError(f"--runner must be auto, generate or pooling, got {self.runner!r}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ConfigError(f"--pooling-type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        self._validate_kv_disk()
        self._validate_lora()

    def _validate_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if tp < 1:
            raise ConfigError("--tensor-parallel-size must be at least 1")
        if tp == 1:
            return
        # Each rank runs the same packed step; these features keep state or work outside that step.
        refused = {
            "--speculative-config": (
                self.speculative_config is not None,
                "its draft and verify forwards are not sent to the other ranks",
            ),
            "--enable-lora": (self.enable_lora, "adapter weights are not split over the ranks"),
            "--kv-disk-dir": (
                self.kv_disk_dir is not None,
                "each rank would have to save and load its own KV heads; only rank 0 runs the tier",
            ),
            "--runner pooling": (
                self.runner == "pooling",
                "the pooling runner's forwards are not sent to the other ranks",
            ),
        }
        for name, (on, why) in refused.items():
            if on:
                raise ConfigError(f"{name} does not work with --tensor-parallel-size > 1 yet: {why}")

    @property
    def world_size(self) -> int:
        """Ranks in the MLX distributed group: pipeline stages times tensor-parallel ranks."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    def _validate_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("--lora-modules needs --enable-lora")
        if self.max_loras < 1:
            raise ConfigError("--max-loras must be at least 1")
        if self.max_lora_rank < 1:
            raise ConfigError("--max-lora-rank must be at least 1")
        if len(self.lora_modules) > self.max_loras:
            raise ConfigError(
                f"--lora-modules names {len(self.lora_modules)} adapters, more than --max-loras {self.max_loras}"
            )
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ConfigError("--lora-modules: each adapter needs a name of its own")
        if self.enable_lora and self.pipeline_parallel_size > 1:
            raise ConfigError("--enable-lora does not work with --pipeline-parallel-size > 1 yet")

    def _validate_kv_disk(self) -> None:
        if self.kv_disk_size is not None and self.kv_disk_dir is None:
            raise ConfigError("--kv-disk-size needs --kv-disk-dir (the disk tier is off without a directory)")
        if self.kv_disk_dir is None:
            return
        if not self.kv_disk_dir.strip():
            raise ConfigError("--kv-disk-dir must name a directory")
        if self.kv_disk_size is not None and self.kv_disk_size < 1:
            raise ConfigError("--kv-disk-size must be a positive number of bytes")
        if not self.enable_prefix_caching:
            raise ConfigError("--kv-disk-dir needs prefix caching (its blocks are found by the prefix hash chain)")
        if self.pipeline_parallel_size > 1:
            raise ConfigError("--kv-disk-dir does not work with --pipeline-parallel-size > 1 yet")

    @property
    def kv_disk_bytes(self) -> int:
        return DEFAULT_KV_DISK_SIZE if self.kv_disk_size is None else self.kv_disk_size
