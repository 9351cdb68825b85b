"""What the engine core hands back to the frontend after each step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """The sampled token's log-probability and the top-n alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # among the whole vocabulary, 1 the best (prompt logprobs; None: not computed)


@dataclass(kw_only=True)
class EngineCoreOutput:
    """A delta for one request: the tokens generated in this step, and why it finished if it did.
    Keywords only: most fields are optional, and a row of positional Nones says nothing."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # sampling_params.prompt_logprobs: every prompt token's (the first None), in the request's first output.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A pooling request's result (sampling_params.pooling), in its only output, which finishes it.
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
