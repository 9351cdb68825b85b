"""How a `PagedModel` computes outside attention: all in MLX (here) or partly on the host (executor/host/).

The strategy is chosen once from the Platform (`metalserve.executor.host.choose_compute`); the model
itself never asks which device it runs on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from metalserve.executor.models.adapter import PagedModel


class ModelCompute(Protocol):
    def install(self, model: PagedModel) -> None:
        """Swap in this strategy's modules and materialise what it needs (once, at construction)."""

    def forward(self, model: PagedModel, token_ids: np.ndarray, logits_indices: np.ndarray) -> mx.array:
        """Packed token ids `[T]` -> the logits `[S, vocab]` of the rows `logits_indices`."""

    def host_job(
        self, model: PagedModel, token_ids: np.ndarray, logits_indices: np.ndarray
    ) -> Callable[[], np.ndarray] | None:
        """The forward as a call that touches NumPy only (None: part of it runs in MLX)."""

    def description(self) -> str:
        """What runs on the host instead of MLX, for the start-up log."""

    def host_bytes(self) -> int:
        """Bytes of weights held outside MLX, which MLX's memory counters do not see."""


class MlxCompute:
    """Everything in MLX: mlx-lm's modules, the embedding or lm_head as the vocabulary projection."""

    def install(self, model: PagedModel) -> None:
        return None

    def forward(self, model: PagedModel, token_ids: np.ndarray, logits_indices: np.ndarray) -> mx.array:
        hidden = model.mlx_hidden_states(mx.array(token_ids))
        return model.mlx_logits(hidden[mx.array(logits_indices)])

    def host_job(
        self, model: PagedModel, token_ids: np.ndarray, logits_indices: np.ndarray
    ) -> Callable[[], np.ndarray] | None:
        return None

    def description(self) -> str:
        return "nothing (all in MLX)"

    def host_bytes(self) -> int:
        return 0
