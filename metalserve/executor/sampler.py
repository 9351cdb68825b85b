"""The batched sampler: one call per step turns the logits of the sampling requests into token ids.

Order (vLLM V1 / OpenAI): logit bias, min_tokens masking, penalties; then greedy argmax or temperature,
top-k, top-p, min-p and a draw. Logprobs come from the raw logits. Rows that need no work skip it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from metalserve.executor.logprobs import PendingLogprobs
from metalserve.executor.penalties import apply_logit_bias, apply_min_tokens, apply_penalties
from metalserve.executor.sampling_metadata import SamplingRequest, StepPlan, plan_step
from metalserve.executor.seeding import UniformSource
from metalserve.executor.truncation import sample_rows
from metalserve.outputs import TokenLogprob

__all__ = ["Sampler", "SamplerOutput", "SamplingRequest"]


@dataclass
class SamplerOutput:
    """One sampled token per row, and its logprobs where the request asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Samples a step's batch with MLX ops; requests with a seed get a stream of their own.

    `seed` seeds the engine-wide stream that requests without a seed draw from.
    """

    def __init__(self, seed: int = 0) -> None:
        self._uniforms = UniformSource(seed)

    def __call__(self, logits: mx.array, requests: Sequence[SamplingRequest]) -> SamplerOutput:
        _check_shape(logits, requests)
        plan = plan_step(requests)
        if plan.argmax_only:
            return SamplerOutput(mx.argmax(logits, axis=-1).tolist(), [None] * len(requests))  # type: ignore[arg-type]
        processed = self._process(logits, requests, plan)
        tokens = self._choose(processed, requests, plan)
        pending = None
        if plan.logprob_rows:
            top_n = [requests[row].sampling_params.logprobs or 0 for row in plan.logprob_rows]
            pending = PendingLogprobs(logits, plan.logprob_rows, tokens, top_n)
        mx.eval(tokens, *(pending.arrays() if pending else []))
        token_ids: list[int] = tokens.tolist()  # type: ignore[assignment]
        if pending is None:
            return SamplerOutput(token_ids, [None] * len(requests))
        return SamplerOutput(token_ids, pending.resolve(token_ids, len(requests)))

    @staticmethod
    def _process(logits: mx.array, requests: Sequence[SamplingRequest], plan: StepPlan) -> mx.array:
        """float32 logits after logit bias, min_tokens masking and penalties."""
        vocab = logits.shape[-1]
        x = logits.astype(mx.float32)
        x = apply_logit_bias(x, requests, plan.bias_rows, vocab)
        x = apply_min_tokens(x, requests, plan.min_tokens_rows, vocab)
        return apply_penalties(x, requests, plan.penalty_rows, vocab)

    def _choose(self, x: mx.array, requests: Sequence[SamplingRequest], plan: StepPlan) -> mx.array:
        """[B] int32 token ids: argmax for greedy rows, a draw for the others."""
        if not plan.random_rows:
            return mx.argmax(x, axis=-1).astype(mx.int32)
        rows = plan.random_rows
        chosen = [requests[row] for row in rows]
        uniforms = self._uniforms.draw(
            [r.sampling_params.seed for r in chosen],
            [len(r.output_token_ids) if r.sampling_params.seed is not None else 0 for r in chosen],
        )
        subset = x if len(rows) == x.shape[0] else x[mx.array(rows)]
        drawn = sample_rows(subset, [r.sampling_params for r in chosen], uniforms)
        if not plan.greedy_rows:
            return drawn
        scattered = mx.zeros((x.shape[0],), dtype=mx.int32).at[mx.array(rows)].add(drawn)
        is_greedy = mx.zeros((x.shape[0],), dtype=mx.bool_).at[mx.array(plan.greedy_rows)].add(True)
        return mx.where(is_greedy, mx.argmax(x, axis=-1).astype(mx.int32), scattered)


def _check_shape(logits: mx.array, requests: Sequence[SamplingRequest]) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if logits.shape[0] != len(requests):
        raise ValueError(f"logits have {logits.shape[0]} rows but {len(requests)} requests were given")
    if not mx.issubdtype(logits.dtype, mx.floating):
        raise ValueError(f"logits must be a float array, got {logits.dtype}")
