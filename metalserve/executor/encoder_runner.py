"""The runner of an encoder pooling model (BERT family): every request is one whole prompt in one step
(bidirectional attention: no chunk sees the next one's tokens, and no KV is kept), pooled at once.

Two forwards, one interface (`Encoder`: packed prompts in, their last hidden states out):
- `HostBert` (executor/bert_host.py): BERT on NumPy's BLAS and numba, over the packed token axis with no
  padding; what a BERT runs on MLX's CPU backend (where MLX's GELU and softmax are slow), and what a
  BERT cross-encoder runs everywhere (mlx-embeddings has no classification head).
- `MlxEncoder`: mlx-embeddings' classes (XLM-R, ModernBERT, and BERT on Metal) over length-sorted padded
  batches: bidirectional attention on our packed axis would need a block-diagonal [T, T] mask, while
  sorted short sentences pad little.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metalserve.executor.runner import InFlightStep
from metalserve.pooling_params import PoolingParams
from metalserve.scheduler.output import ModelRunnerOutput, SchedulerOutput

# The most padded tokens (batch x longest prompt) one padded batch may take.
PADDED_TOKENS_PER_BATCH = 8192


class Encoder(Protocol):
    def forward(self, ids: np.ndarray, token_types: np.ndarray, cu_seqlens: np.ndarray) -> np.ndarray:
        """The last hidden states `[T, hidden]` float32 of the packed prompts `ids[cu[i]:cu[i+1]]`."""
        ...

    def classify(self, first_rows: np.ndarray) -> np.ndarray:
        """A cross-encoder's logits `[n, labels]` from its prompts' first hidden states."""
        ...


class MlxEncoder:
    """An mlx-embeddings model as an `Encoder`: padded batches of consecutive (length-sorted) prompts."""

    def __init__(self, model: nn.Module, pad_token_id: int = 0) -> None:
        self.model = model
        self.pad_token_id = pad_token_id

    def forward(self, ids: np.ndarray, token_types: np.ndarray, cu_seqlens: np.ndarray) -> np.ndarray:
        if token_types.any():
            raise ValueError("this encoder is not served as a cross-encoder (token types of a pair)")
        spans = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True))
        out: list[np.ndarray] = []
        for batch in _batches(spans):
            width = max(b - a for a, b in batch)
            padded = np.full((len(batch), width), self.pad_token_id, dtype=np.int32)
            mask = np.zeros((len(batch), width), dtype=np.float32)
            for row, (a, b) in enumerate(batch):
                padded[row, : b - a] = ids[a:b]
                mask[row, : b - a] = 1.0
            result: Any = self.model(mx.array(padded), attention_mask=mx.array(mask))
            hidden = np.asarray(result.last_hidden_state.astype(mx.float32))
            out.extend(hidden[row, : b - a] for row, (a, b) in enumerate(batch))
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)

    def classify(self, first_rows: np.ndarray) -> np.ndarray:
        raise ValueError("mlx-embeddings' encoders have no classification head")


class EncoderRunner:
    """What EngineCore calls on a runner, for an encoder: no KV, no sampling, pooled vectors out.
    `sep_token_id`: where a cross-encoder's pair turns to its second segment."""

    def __init__(self, encoder: Encoder, sep_token_id: int | None = None) -> None:
        self.encoder = encoder
        self.sep_token_id = sep_token_id
        self.connector = None  # no KV, so no KV connector
        self.encoder_outputs = None  # no images
        self.pooling_model = True
        self.lora: None = None  # encoders take no LoRA adapters

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.finish(self.launch(so, overlap=False))

    def launch(self, so: SchedulerOutput, overlap: bool = True) -> InFlightStep:
        """Run the step's prompts (the host computes now; `finish` hands the vectors on). Every scheduled
        request is new and scheduled whole (the scheduler's `whole_prompts`)."""
        requests = []
        for new in so.scheduled_new_reqs:
            if so.num_scheduled_tokens.get(new.request_id) != len(new.token_ids) or new.num_computed_tokens:
                raise ValueError(f"request {new.request_id}: an encoder runs whole prompts only")
            params = new.sampling_params.pooling
            if params is None:
                raise ValueError(f"request {new.request_id}: an encoder model serves pooling requests only")
            if params.logit_token_ids is not None:
                raise ValueError("an encoder model has no vocabulary logits to score with")
            requests.append((new.request_id, new.token_ids, params))
        requests.sort(key=lambda r: len(r[1]))  # padded batches of similar lengths (MlxEncoder)
        pooled = self._encode(requests) if requests else {}
        return InFlightStep(so, None, time.perf_counter(), None, None, pooled)  # type: ignore[arg-type]

    def finish(self, flight: InFlightStep) -> ModelRunnerOutput:
        pooled: dict[str, Any] = flight.pooled or {}
        return ModelRunnerOutput(sampled_token_ids={}, pooled={rid: v.tolist() for rid, v in pooled.items()})

    def _encode(self, requests: Sequence[tuple[str, list[int], PoolingParams]]) -> dict[str, np.ndarray]:
        cu = np.cumsum([0] + [len(ids) for _, ids, _ in requests]).astype(np.int64)
        ids = np.concatenate([np.asarray(t, dtype=np.int64) for _, t, _ in requests])
        types = np.zeros_like(ids)
        for i, (_, _, params) in enumerate(requests):
            if params.classify:
                if self.sep_token_id is None:
                    raise ValueError("this encoder's tokenizer has no [SEP] token to split a pair at")
                seps = np.flatnonzero(ids[cu[i] : cu[i + 1]] == self.sep_token_id)
                if seps.size:  # BERT's pair encoding: segment 1 after the first [SEP]
                    types[cu[i] + seps[0] + 1 : cu[i + 1]] = 1
        hidden = self.encoder.forward(ids, types, cu)
        classify = [i for i, (_, _, p) in enumerate(requests) if p.classify]
        logits = dict(zip(classify, self.encoder.classify(hidden[cu[classify]]), strict=True)) if classify else {}
        vectors: dict[str, np.ndarray] = {}
        for i, (rid, _, params) in enumerate(requests):
            if params.classify:
                vectors[rid] = logits[i].astype(np.float32)
                continue
            rows = hidden[cu[i] : cu[i + 1]]
            kind = params.pooling_type
            vector = rows.mean(axis=0) if kind == "mean" else rows[0] if kind == "cls" else rows[-1]
            vectors[rid] = finish_host_vector(vector, params)
        return vectors


def finish_host_vector(vector: np.ndarray, params: PoolingParams) -> np.ndarray:
    """Matryoshka truncation first, then unit length (as executor/pooling.py's finish_vector)."""
    if params.dimensions is not None:
        if params.dimensions > vector.shape[-1]:
            raise ValueError(f"dimensions {params.dimensions} is more than the model's {vector.shape[-1]}")
        vector = vector[: params.dimensions]
    vector = vector.astype(np.float32)
    if params.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector


def _batches(spans: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Consecutive runs of the (length-sorted) prompts whose padded size stays within the budget."""
    batches: list[list[tuple[int, int]]] = []
    for a, b in spans:
        if batches and (len(batches[-1]) + 1) * (b - a) <= PADDED_TOKENS_PER_BATCH:
            batches[-1].append((a, b))
        else:
            batches.append([(a, b)])
    return batches
