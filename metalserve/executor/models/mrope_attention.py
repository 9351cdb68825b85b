"""Paged attention for Qwen2-VL's language model (mlx-vlm's): multimodal RoPE over positions `[3, T]`.

The step's positions are three rows (time, height, width; multimodal/mrope.py); mlx-vlm's own rotary
module applies them, with the packed axis as one sequence of T tokens, each at its own positions. All
else (projections, the paged K/V, the backend call) is `PagedAttention`'s.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from metalserve.executor.models.paged_attention import PagedAttention


class PagedMRoPEAttention(PagedAttention):
    """Replaces an mlx-vlm Qwen2-VL attention; its layer passes `position_ids`/`position_embeddings`,
    which the step's context replaces (so they are ignored here)."""

    def _project(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array | None, mx.array | None]:
        t, hq, hkv = x.shape[1], self.n_heads, self.n_kv_heads
        if positions.ndim == 1:  # text positions (the memory plan's warm-up step): the same in all three rows
            positions = mx.broadcast_to(positions[None], (3, t))
        q, k, v = self._linear(x)
        assert k is not None and v is not None
        q = q.reshape(1, t, hq, -1).transpose(0, 2, 1, 3)
        k = k.reshape(1, t, hkv, -1).transpose(0, 2, 1, 3)
        q, k = self.inner.rotary_emb.apply_rotary(q, k, positions[:, None, :], unsqueeze_dim=1)
        return q[0].transpose(1, 0, 2), k[0].transpose(1, 0, 2), v.reshape(t, hkv, -1)

    def __call__(
        self,
        x: mx.array,
        mask: Any = None,
        cache: Any = None,
        position_ids: Any = None,
        position_embeddings: Any = None,
    ) -> Any:
        return super().__call__(x)
