"""What the async engine streams back per request, and the per-step stats it reports."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from metalserve.engine.protocol import SchedulerStatsLike
from metalserve.outputs import TokenLogprob


@dataclass
class RequestOutput:
    """A delta for one request as the serving layer sees it: new text, new tokens, and the end."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int  # cumulative
    prompt_logprobs: list[TokenLogprob | None] | None = None  # sampling_params.prompt_logprobs; first output
    pooled: list[float] | None = None  # a pooling request's vector (or scores), in its only output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merged_with(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by `later` as one delta (a reader that fell behind gets them at once)."""
        logprobs = (
            None
            if self.logprobs is None and later.logprobs is None
            else ((self.logprobs or []) + (later.logprobs or []))
        )
        return replace(
            later,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            pooled=later.pooled or self.pooled,
        )


@dataclass
class IterationStats:
    """What one step produced, for the metrics: token counts and latencies in seconds."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[tuple[str, float]] = field(default_factory=list)  # (finish_reason, e2e latency)
    # Requests under a LoRA adapter: generated tokens by adapter name, and (adapter, finish_reason) of those ending.
    lora_generation_tokens: dict[str, int] = field(default_factory=dict)
    lora_finished: list[tuple[str, str]] = field(default_factory=list)
    num_pooling_requests: int = 0  # pooling requests (embeddings, score, rerank inputs) finished this step


class EngineObserver(Protocol):
    """Receives the scheduler snapshot and the iteration stats after every step (worker thread)."""

    def on_step(self, scheduler_stats: SchedulerStatsLike, iteration: IterationStats) -> None: ...
