"""Attention backends behind one seam (base.py): Metal kernel, MLX ops, numba CPU kernel."""

from metalserve.executor.attention.base import AttentionBackend, AttentionCall, LayerCache, LayerCacheSpec
from metalserve.executor.attention.mlx import MlxAttention, PortableKV

__all__ = ["AttentionBackend", "AttentionCall", "LayerCache", "LayerCacheSpec", "MlxAttention", "PortableKV"]
