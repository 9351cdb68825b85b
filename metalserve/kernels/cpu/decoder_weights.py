"""The arrays the one-call host decoder (kernels/cpu/decoder.py) reads, as NamedTuples numba can take.

Kept apart from the kernel so the executor can build them without importing numba (absent on macOS).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class StackedLinear(NamedTuple):
    """One projection of every layer: codes `[L, out, in]` uint8, scales/biases `[L, out, groups]`,
    and the layer's own bias `[L, out]` (zeros where it has none)."""

    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bias: np.ndarray


class DecoderWeights(NamedTuple):
    """The weights of `L` identical pre-norm blocks, stacked on a leading layer axis."""

    input_norm: np.ndarray  # [L, hidden]
    post_attention_norm: np.ndarray  # [L, hidden]
    qkv: StackedLinear
    o: StackedLinear
    gate_up: StackedLinear
    down: StackedLinear
    q_norm: np.ndarray  # [L, head_dim]; qwen3's per-head norms (unused unless `DecoderShape.head_norms`)
    k_norm: np.ndarray
    rope_inv_freq: np.ndarray  # [rope_dims // 2]
    sliding_windows: np.ndarray  # [L] int64, 0 for full attention


class DecoderShape(NamedTuple):
    n_heads: int
    n_kv_heads: int
    head_dim: int
    head_norms: bool
    norm_eps: float
    head_norm_eps: float
    rope_scale: float
    attention_scale: float
    softcap: float  # 0 for none
