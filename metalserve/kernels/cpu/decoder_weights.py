"""The arrays the one-call host decoder (kernels/cpu/decoder.py) reads, as NamedTuples numba can take.

Kept apart from the kernel so the executor can name them without importing numba (absent on macOS).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from metalserve.kernels.cpu.packed_linear import Segments

# The model types whose blocks the host decoder reproduces (dense: pre-norm RMSNorm, RoPE, a gated MLP;
# gemma3's sandwich norms, GeGLU and per-layer RoPE; phi3's fused projections and SuScaledRoPE); every
# other family runs mlx-lm's own modules on MLX. The loader keeps such a GGUF in its codes alone (no fp32
# copy), the executor installs the host twins (executor/models/families.py).
HOST_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3"})


class DecoderWeights(NamedTuple):
    """The weights of `L` pre-norm blocks of one shape, stacked on a leading layer axis."""

    input_norm: np.ndarray  # [L, hidden]
    post_attention_norm: np.ndarray  # [L, hidden]: the norm before the MLP (gemma3's pre_feedforward)
    attn_out_norm: np.ndarray  # [L, hidden]: gemma3's norm of the attention's output (`DecoderShape.sandwich_norms`)
    mlp_out_norm: np.ndarray  # [L, hidden]: gemma3's norm of the MLP's output
    qkv: Segments  # each projection of every layer, in its packed codes (kernels/cpu/packed_linear.py)
    o: Segments
    gate_up: Segments
    down: Segments
    q_norm: np.ndarray  # [L, head_dim]; qwen3's per-head norms (unused unless `DecoderShape.head_norms`)
    k_norm: np.ndarray
    rope_inv_freq: np.ndarray  # [L, rope_dims // 2] (gemma3's sliding and full layers differ)
    rope_scales: np.ndarray  # [L] float32: positions times this (linear RoPE scaling)
    rope_mscales: np.ndarray  # [L] float32: rotated features times this first (SuScaledRoPE), else 1
    sliding_windows: np.ndarray  # [L] int64, 0 for full attention


class DecoderShape(NamedTuple):
    n_heads: int
    n_kv_heads: int
    head_dim: int
    head_norms: bool
    norm_eps: float
    head_norm_eps: float
    attention_scale: float
    softcap: float  # 0 for none
    sandwich_norms: bool  # gemma3: the attention's and the MLP's outputs normed before the residual adds
    gelu: bool  # the MLP's gate through GELU (tanh), gemma3; else SiLU


class PagePlane(NamedTuple):
    """One plane (K or V) of a layer's quantized pages, for every KV head (kernels/cpu/page_codes.py)."""

    codes: np.ndarray  # [Hkv, slots, D] int8 codes viewed as uint8, or [Hkv, slots, D/2] q4 nibbles
    scales: np.ndarray  # [Hkv, slots, groups] float16 bits as uint16 (int8: one group)
    biases: np.ndarray  # q4's, likewise; int8 pages have none and repeat `scales` here
    storage: int  # page_codes.INT8 or page_codes.Q4


class QuantPages(NamedTuple):
    """A layer's quantized pages: K and V each in its own storage."""

    k: PagePlane
    v: PagePlane


PAGE_STORAGES = {"int8": 1, "q4": 2}  # PagePlane.storage by --kv-cache-dtype (page_codes.INT8, Q4)


def quant_pages(views: list[np.ndarray], v_views: list[np.ndarray] | None = None) -> QuantPages:
    """A layer's pages from the host views of its `[2, Hkv, slots, ...]` codes, scales (and q4's biases),
    sharing their memory. `v_views`: V's own `[1, Hkv, slots, ...]` arrays where K and V are stored apart
    (k8v4, kv_quant.SplitPool); `views` are then K's alone, and each plane names its own storage."""
    if v_views is None:
        return QuantPages(_page_plane(views, 0), _page_plane(views, 1))
    return QuantPages(_page_plane(views, 0), _page_plane(v_views, 0))


def _page_plane(views: list[np.ndarray], i: int) -> PagePlane:
    codes, scales = views[0], views[1]
    biases = views[2] if len(views) > 2 else scales
    storage = PAGE_STORAGES["int8" if codes.dtype == np.int8 else "q4"]
    return PagePlane(codes[i].view(np.uint8), scales[i].view(np.uint16), biases[i].view(np.uint16), storage)


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
