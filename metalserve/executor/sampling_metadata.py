"""The host-side description of one sampling step: which rows need which work, and their parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from metalserve.sampling_params import SamplingParams, SamplingRequest

# Below this temperature a row is sampled greedily: dividing by it would overflow float32 (as in vLLM).
GREEDY_TEMPERATURE = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def needs_min_tokens_mask(request: SamplingRequest) -> bool:
    """True while the request is below min_tokens and has EOS or stop ids that must not be sampled."""
    params = request.sampling_params
    if params.min_tokens == 0 or request.num_output_tokens >= params.min_tokens:
        return False
    return bool(params.stop_ids(request.eos_token_ids))


@dataclass(frozen=True)
class StepPlan:
    """Row subsets for one step; each list holds row indices into the batch, in order."""

    greedy_rows: list[int]
    random_rows: list[int]
    bias_rows: list[int]
    penalty_rows: list[int]
    min_tokens_rows: list[int]
    logprob_rows: list[int]
    grammar_rows: list[int]  # rows whose next token a grammar constrains

    @property
    def argmax_only(self) -> bool:
        """Every row greedy with nothing that changes its logits or asks for logprobs: one argmax."""
        changes = self.bias_rows or self.penalty_rows or self.min_tokens_rows or self.grammar_rows
        return not (self.random_rows or changes or self.logprob_rows)


def plan_step(requests: Sequence[SamplingRequest]) -> StepPlan:
    """Sort the rows by the work they need, reading each request's parameters once."""
    greedy: list[int] = []
    random: list[int] = []
    bias: list[int] = []
    penalty: list[int] = []
    min_tokens: list[int] = []
    logprob: list[int] = []
    grammar: list[int] = []
    for i, request in enumerate(requests):
        params = request.sampling_params
        (greedy if is_greedy(params) else random).append(i)
        if params.logit_bias:
            bias.append(i)
        if has_penalties(params):
            penalty.append(i)
        if needs_min_tokens_mask(request):
            min_tokens.append(i)
        if params.logprobs is not None:
            logprob.append(i)
        structured = getattr(request, "structured", None)
        if structured is not None and structured.constrains_next:
            grammar.append(i)
    return StepPlan(greedy, random, bias, penalty, min_tokens, logprob, grammar)
