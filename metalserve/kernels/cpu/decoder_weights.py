"""The arrays the one-call host decoder (kernels/cpu/decoder.py) reads, as NamedTuples numba can take.

Kept apart from the kernel so the executor can name them without importing numba (absent on macOS).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from metalserve.kernels.cpu.packed_linear import Segments

# The model types whose blocks the host decoder reproduces (dense llama-family: pre-norm RMSNorm, plain
# RoPE, SwiGLU); every other family runs mlx-lm's own modules on MLX. The loader keeps such a GGUF in its
# codes alone (no fp32 copy), the executor installs the host twins (executor/models/families.py).
HOST_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class DecoderWeights(NamedTuple):
    """The weights of `L` identical pre-norm blocks, stacked on a leading layer axis."""

    input_norm: np.ndarray  # [L, hidden]
    post_attention_norm: np.ndarray  # [L, hidden]
    qkv: Segments  # each projection of every layer, in its packed codes (kernels/cpu/packed_linear.py)
    o: Segments
    gate_up: Segments
    down: Segments
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


class LoraProjection(NamedTuple):
    """Every adapter slot's A and B of one (fused) projection in every layer, for kernels/cpu/lora.py.

    Part p of the projection (q, k, v of a fused qkv) owns output columns `bounds[p]:bounds[p + 1]` and
    ranks `p * R:(p + 1) * R` of A; B is stored transposed, each part in its own rows of it."""

    a: np.ndarray  # [L, slots, in, parts * R] float32
    bt: np.ndarray  # [L, slots, out, R] float32: B transposed
    bounds: np.ndarray  # [parts + 1] int64


class DecoderLora(NamedTuple):
    qkv: LoraProjection
    o: LoraProjection
    gate_up: LoraProjection
    down: LoraProjection


def no_lora() -> DecoderLora:
    """No adapter slots: the decoder's LoRA loops find no groups (and numba sees the same types)."""
    empty = LoraProjection(
        np.zeros((0, 0, 0, 0), np.float32), np.zeros((0, 0, 0, 0), np.float32), np.zeros(1, np.int64)
    )
    return DecoderLora(empty, empty, empty, empty)


class HostLoraStep(NamedTuple):
    """A step's adapter tokens for the numba decoder (lora/layers.py: lora_step builds it): group g is
    slot `group_slot[g]`, packed rows `rows[group_start[g]:group_start[g + 1]]`, each at its request's scale."""

    rows: np.ndarray  # [n] int64
    scales: np.ndarray  # [n] float32
    group_start: np.ndarray  # [G + 1] int64
    group_slot: np.ndarray  # [G] int64


NO_HOST_LORA = HostLoraStep(
    np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(1, np.int64), np.zeros(0, np.int64)
)
