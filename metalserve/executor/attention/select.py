"""Which attention backend runs, chosen once at start-up from --attention-backend, the Platform and the
model's dtype."""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import mlx.core as mx

from metalserve.config import ATTENTION_BACKEND_NAMES, ConfigError
from metalserve.executor.attention.base import AttentionBackend
from metalserve.executor.attention.mlx import MlxAttention
from metalserve.executor.attention.rotation import RotatedPages
from metalserve.platform import Platform

logger = logging.getLogger("metalserve.engine")


# Why only MLX ops serve Gemma 3's images (executor/attention/mlx_ops.py: _window_mask's spans).
NO_IMAGE_MASKS = "it has no per-request mask for image tokens that attend to each other both ways (Gemma 3)"
# Why the Metal kernel is not chosen for MLA models (executor/models/mla.py).
METAL_NO_LATENT = "the Metal kernel has no MLA latent layout (V a slice of K, one KV head of width kv_lora + rope)"


def select_attention(
    name: str,
    dtype: mx.Dtype,
    platform: Platform,
    head_dims: Collection[int] = (),
    *,
    latent_kv: bool = False,
    kv_storage: str = "auto",
    image_masks: bool = False,
) -> AttentionBackend[Any, Any]:
    """`auto`: the Metal kernel where Metal exists and takes the model's head dims (`head_dims`, every
    attention layer's), else the CPU backend for float32 KV, else MLX ops. Every backend honours sliding
    windows, sinks and the logit soft-cap; only the Metal kernel is limited, to its head dims and to
    separate K and V (`latent_kv`: the model keeps MLA's latent pages, LayerCacheSpec.value_dim).
    `kv_storage`: the pages' storage (--kv-cache-dtype); a backend that cannot read it is not chosen.
    `image_masks`: the model's image tokens attend to each other both ways (Gemma 3): MLX ops only.
    Quantized pages are stored Hadamard-rotated (rotation.py), whichever backend reads them."""
    backend = _pick(name, dtype, platform, head_dims, latent_kv, kv_storage, image_masks)
    return RotatedPages(backend) if kv_storage != "auto" else backend


def _pick(
    name: str,
    dtype: mx.Dtype,
    platform: Platform,
    head_dims: Collection[int],
    latent_kv: bool,
    kv_storage: str,
    image_masks: bool,
) -> AttentionBackend[Any, Any]:
    if name not in ATTENTION_BACKEND_NAMES:
        raise ConfigError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKEND_NAMES)}, got {name!r}")
    if name == "mlx":
        return MlxAttention()
    if image_masks:  # only the MLX-ops plan masks per request (an image's tokens see each other both ways)
        if name != "auto":
            raise ConfigError(f"--attention-backend {name}: {NO_IMAGE_MASKS}; use 'auto' or 'mlx'")
        logger.info("attention: MLX ops, the backend that attends an image's tokens both ways")
        return MlxAttention()
    if kv_storage not in QUANTIZED_PAGE_BACKENDS.get(name, ("auto",)) and name != "auto":
        raise ConfigError(f"--attention-backend {name} cannot read {kv_storage} KV pages; use 'auto' or 'mlx'")
    if kv_storage != "auto" and name == "auto" and not _auto_reads(kv_storage, platform, dtype):
        logger.info("attention: MLX ops, the backend that reads %s KV pages here", kv_storage)
        return MlxAttention()
    if name == "metal" and latent_kv:
        raise ConfigError(f"--attention-backend metal: {METAL_NO_LATENT}; use 'auto' or 'mlx'")
    if name == "auto" and platform.metal and latent_kv:
        logger.info("attention: not the Metal kernel: %s", METAL_NO_LATENT)
        return MlxAttention()
    if name == "metal" or (name == "auto" and platform.metal):
        if not platform.metal:
            raise ConfigError("--attention-backend metal: it needs a Metal device; use 'auto' or 'mlx'")
        problem = metal_kernel_problem(head_dims)
        if problem and name == "metal":
            raise ConfigError(f"--attention-backend metal: {problem}; use 'auto' or 'mlx'")
        if problem:
            logger.warning("attention: MLX ops instead of the Metal kernel: %s", problem)
            return MlxAttention()
        from metalserve.executor.attention.metal import metal_attention

        return metal_attention()
    problem = cpu_backend_problem(dtype, platform)
    if name == "cpu" and problem:
        raise ConfigError(f"--attention-backend cpu: {problem}")
    if problem:
        return MlxAttention()
    from metalserve.executor.attention.cpu import CpuAttention

    return CpuAttention()


# The page storages each backend reads besides the model's dtype (kvcache/specs.PageDtype).
QUANTIZED_PAGE_BACKENDS: dict[str, tuple[str, ...]] = {
    "mlx": ("auto", "int8", "q4", "k8v4"),
    "cpu": ("auto", "int8", "q4", "k8v4"),
    "metal": ("auto", "int8", "q4"),
}


def _auto_reads(storage: str, platform: Platform, dtype: mx.Dtype) -> bool:
    """Whether the backend `auto` would pick reads pages of `storage`."""
    picked = "metal" if platform.metal else ("cpu" if cpu_backend_problem(dtype, platform) is None else "mlx")
    return storage in QUANTIZED_PAGE_BACKENDS[picked]


def cpu_backend_problem(dtype: mx.Dtype, platform: Platform) -> str | None:
    if not platform.numba:
        return "it needs the numba package (pip install numba)"
    if dtype != mx.float32:
        return f"it needs float32 activations and KV, and this model computes in {dtype} (see --weights)"
    return None


def metal_kernel_problem(head_dims: Collection[int]) -> str | None:
    from metalserve.kernels.metal.paged import HEAD_DIMS

    unsupported = sorted(set(head_dims) - set(HEAD_DIMS))
    if unsupported:
        return f"the Metal kernel takes head dims {HEAD_DIMS}, and this model has {unsupported}"
    return None
