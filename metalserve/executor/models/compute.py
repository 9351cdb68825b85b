"""The all-MLX compute strategy of a `PagedModel` (the protocol, `ModelCompute`, is the adapter's).

The strategy is chosen once from the Platform (`metalserve.executor.host.choose_compute`); the model
itself never asks which device it runs on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import mlx.core as mx
import numpy as np


class MlxForward(Protocol):
    """What the all-MLX path calls on the model (models/adapter.py: PagedModel)."""

    def mlx_hidden_states(self, token_ids: mx.array) -> mx.array: ...

    def mlx_logits(self, hidden: mx.array) -> mx.array: ...


class MlxCompute:
    """Everything in MLX: mlx-lm's modules, the embedding or lm_head as the vocabulary projection."""

    def install(self, model: MlxForward) -> None:
        return None

    def forward(self, model: MlxForward, token_ids: np.ndarray, logits_indices: np.ndarray) -> mx.array:
        hidden = model.mlx_hidden_states(mx.array(token_ids))
        return model.mlx_logits(hidden[mx.array(logits_indices)])

    def host_job(
        self, model: MlxForward, token_ids: np.ndarray, logits_indices: np.ndarray
    ) -> Callable[[], np.ndarray] | None:
        return None

    def description(self) -> str:
        return "nothing (all in MLX)"

    def host_bytes(self) -> int:
        return 0
