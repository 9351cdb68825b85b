"""The runner of an encoder pooling model (BERT family, through mlx-embeddings' classes): every request is
one whole prompt in one step (bidirectional attention: no chunk sees the next one's tokens, and no KV
is kept), run as length-sorted padded batches, and pooled at once.

Why padded batches of mlx-embeddings' modules and not our packed token axis: an encoder's attention is
bidirectional within each prompt, so the packed axis would need a block-diagonal [T, T] mask (or a
variable-length bidirectional kernel we do not have); sentences are short, and sorting them by length
keeps the padding small, so one batched matmul attention per layer is the cheaper form here."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.executor.pooling import finish_vector
from metalserve.executor.runner import InFlightStep
from metalserve.pooling_params import PoolingParams
from metalserve.scheduler.output import ModelRunnerOutput, SchedulerOutput

# The most padded tokens (batch x longest prompt) one batch of the step may take.
PADDED_TOKENS_PER_BATCH = 8192


class EncoderRunner:
    """What EngineCore calls on a runner, for an encoder: no KV, no sampling, pooled vectors out."""

    def __init__(self, model: nn.Module, pad_token_id: int = 0) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.connector = None  # no KV, so no KV connector
        self.encoder_outputs = None  # no images
        self.pooling_model = True
        self.lora: None = None  # encoders take no LoRA adapters

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.finish(self.launch(so, overlap=False))

    def launch(self, so: SchedulerOutput, overlap: bool = True) -> InFlightStep:
        """Build the step's batches (lazy); `finish` evaluates them. Every scheduled request is new and
        scheduled whole (the scheduler's `whole_prompts`)."""
        requests = []
        for new in so.scheduled_new_reqs:
            if so.num_scheduled_tokens.get(new.request_id) != len(new.token_ids) or new.num_computed_tokens:
                raise ValueError(f"request {new.request_id}: an encoder runs whole prompts only")
            params = new.sampling_params.pooling
            if params is None:
                raise ValueError(f"request {new.request_id}: an encoder model serves pooling requests only")
            requests.append((new.request_id, new.token_ids, params))
        requests.sort(key=lambda r: len(r[1]))
        pooled: dict[str, mx.array] = {}
        for batch in _batches(requests):
            pooled.update(self._encode(batch))
        if overlap and pooled:
            mx.async_eval(list(pooled.values()))
        return InFlightStep(so, None, time.perf_counter(), None, None, pooled)

    def finish(self, flight: InFlightStep) -> ModelRunnerOutput:
        pooled = flight.pooled or {}
        mx.eval(list(pooled.values()))
        return ModelRunnerOutput(
            sampled_token_ids={}, pooled={rid: np.asarray(v).tolist() for rid, v in pooled.items()}
        )

    def _encode(self, batch: Sequence[tuple[str, list[int], PoolingParams]]) -> dict[str, mx.array]:
        width = max(len(ids) for _, ids, _ in batch)
        ids = np.full((len(batch), width), self.pad_token_id, dtype=np.int32)
        mask = np.zeros((len(batch), width), dtype=np.float32)
        for row, (_, tokens, _) in enumerate(batch):
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1.0
        out: Any = self.model(mx.array(ids), attention_mask=mx.array(mask))
        hidden = out.last_hidden_state.astype(mx.float32)
        mask_mx = mx.array(mask)[..., None]
        means = (hidden * mask_mx).sum(axis=1) / mask_mx.sum(axis=1)
        vectors: dict[str, mx.array] = {}
        for row, (rid, tokens, params) in enumerate(batch):
            if params.logit_token_ids is not None:
                raise ValueError("an encoder model has no vocabulary logits to score with")
            kind = params.pooling_type
            vector = means[row] if kind == "mean" else hidden[row, 0] if kind == "cls" else hidden[row, len(tokens) - 1]
            vectors[rid] = finish_vector(vector, params)
        return vectors


def _batches(requests: list[Any]) -> list[list[Any]]:
    """Consecutive runs of the length-sorted requests whose padded size stays within the budget."""
    batches: list[list[Any]] = []
    for request in requests:
        if batches and (len(batches[-1]) + 1) * len(request[1]) <= PADDED_TOKENS_PER_BATCH:
            batches[-1].append(request)
        else:
            batches.append([request])
    return batches
