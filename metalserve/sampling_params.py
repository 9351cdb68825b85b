"""Per-request sampling parameters, validated once when the request is made."""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field
from typing import Protocol

from metalserve.pooling_params import PoolingParams
from metalserve.structured.params import StructuredOutputsParams

# Bounds the sampler and the API agree on.
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """What to generate and how. Defaults follow the OpenAI API (temperature 1, top_p 1)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token's logprob plus top-k
    # vLLM's prompt_logprobs: each prompt token's logprob (the first has none) plus the top-k; the prompt is
    # then computed whole (no prefix-cache hit), as its logits are needed.
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Grammar-constrained decoding (metalserve/structured/); None: unconstrained.
    structured_outputs: StructuredOutputsParams | None = None
    # A pooling request (embeddings, rerank): prefill only, it returns a pooled vector instead of a token
    # (max_tokens is then 1: nothing is sampled, and the scheduler never schedules a token after it).
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        checks: list[tuple[bool, str]] = [
            (self.n >= 1, "n must be at least 1"),
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be -1, 0 or a positive integer"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty must be > 0"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens must be less than or equal to max_tokens",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be between 0 and {MAX_LOGPROBS}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}",
            ),
            (self.pooling is None or self.max_tokens == 1, "a pooling request generates no tokens (max_tokens 1)"),
            (
                all(-100.0 <= b <= 100.0 for b in self.logit_bias.values()),
                "logit_bias values must be in [-100, 100]",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    # The stop rule, written once: the scheduler ends a request on these ids and the sampler bans them
    # below min_tokens.
    def eos_stop_ids(self, eos_token_ids: Set[int]) -> frozenset[int]:
        """The model's EOS ids that end this request: all of them, or none under ignore_eos."""
        return frozenset() if self.ignore_eos else frozenset(eos_token_ids)

    def stop_ids(self, eos_token_ids: Set[int]) -> frozenset[int]:
        """Every token id that ends this request (once min_tokens outputs exist): its stop_token_ids
        plus EOS unless ignore_eos."""
        return frozenset(self.stop_token_ids) | self.eos_stop_ids(eos_token_ids)


class SamplingRequest(Protocol):
    """What the sampler reads from a request; the runner's per-request state satisfies it."""

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...
