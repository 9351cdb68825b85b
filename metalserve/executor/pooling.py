"""Pooling requests in the packed step: their rows' hidden states become one vector per request.

A prompt may be cut into chunks (chunked prefill), so each request keeps what its earlier chunks left:
the running sum (mean), the first row (CLS). The last token's state (or its logits of a few vocabulary
ids, a decoder reranker's yes/no) is read in the chunk that ends the prompt. The engine thread owns
every array here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from metalserve.executor.input_batch import CachedRequestState
from metalserve.executor.step_inputs import StepInputs
from metalserve.pooling_params import PoolingParams


@dataclass
class PoolingSoFar:
    """What a request's earlier chunks contributed."""

    total: mx.array | None = None  # float32 sum of the rows (mean pooling)
    count: int = 0
    first: mx.array | None = None  # the prompt's first row (CLS pooling)


def pool_step(
    hidden: mx.array,
    step: StepInputs,
    states: dict[str, CachedRequestState],
    so_far: dict[str, PoolingSoFar],
    logits: Callable[[mx.array], mx.array],
) -> dict[str, mx.array]:
    """Fold this step's rows of every pooling request into `so_far`; the finished vectors of those whose
    prompt this step completes (lazy arrays: the caller evaluates them). `logits`: hidden rows -> logits."""
    done: dict[str, mx.array] = {}
    cu = step.cu_seqlens_q
    for i in step.pooling_rows:
        rid = step.request_ids[i]
        state = states[rid]
        params = state.sampling_params.pooling
        assert params is not None
        a, b = int(cu[i]), int(cu[i + 1])
        end = int(step.seq_lens[i])
        start = end - (b - a)
        acc = so_far.setdefault(rid, PoolingSoFar())
        if params.pooling_type == "mean":
            rows = hidden[a:b].astype(mx.float32).sum(axis=0)
            acc.total = rows if acc.total is None else acc.total + rows
            acc.count += b - a
        elif params.pooling_type == "cls" and start == 0:
            acc.first = hidden[a].astype(mx.float32)
        if end < state.num_prompt_tokens:
            continue
        del so_far[rid]
        done[rid] = _vector(params, acc, hidden[b - 1 : b], logits)
    return done


def _vector(
    params: PoolingParams, acc: PoolingSoFar, last: mx.array, logits: Callable[[mx.array], mx.array]
) -> mx.array:
    if params.classify:
        raise ValueError("a decoder model has no classification head (a cross-encoder is a BERT encoder)")
    if params.logit_token_ids is not None:  # scores, not an embedding: neither cut nor normalised
        return logits(last)[0, mx.array(params.logit_token_ids)].astype(mx.float32)
    if params.pooling_type == "mean":
        assert acc.total is not None
        vector = acc.total / acc.count
    elif params.pooling_type == "cls":
        if acc.first is None:
            raise ValueError("CLS pooling over a prompt whose first token was not computed here")
        vector = acc.first
    else:
        vector = last[0].astype(mx.float32)
    return finish_vector(vector, params)


def finish_vector(vector: mx.array, params: PoolingParams) -> mx.array:
    """Matryoshka truncation first, then unit length (sentence-transformers' and vLLM's order)."""
    if params.dimensions is not None:
        if params.dimensions > vector.shape[-1]:
            raise ValueError(f"dimensions {params.dimensions} is more than the model's {vector.shape[-1]}")
        vector = vector[..., : params.dimensions]
    if params.normalize:
        vector = vector / mx.maximum(mx.linalg.norm(vector, axis=-1, keepdims=True), 1e-12)
    return vector
