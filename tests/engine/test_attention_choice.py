"""Which attention backend the engine runs: --attention-backend against the Platform and the model's dtype."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest

from metalserve.config import ConfigError, EngineConfig
from metalserve.executor.attention.cpu import CpuAttention
from metalserve.executor.attention.metal import KernelAttention
from metalserve.executor.attention.mlx import MlxAttention
from metalserve.executor.attention.rotation import RotatedPages
from metalserve.executor.attention.select import select_attention
from metalserve.platform import Platform

CPU_ONLY = Platform(on_cpu=True, metal=False, numba=True, blas="test")
NO_NUMBA = Platform(on_cpu=True, metal=False, numba=False, blas="test")
MAC = Platform(on_cpu=False, metal=True, numba=True, blas="test", metal_memory=1 << 34)


def test_auto_takes_the_cpu_backend_for_float32_and_mlx_ops_otherwise() -> None:
    assert isinstance(select_attention("auto", mx.float32, CPU_ONLY), CpuAttention)
    assert isinstance(select_attention("auto", mx.float16, CPU_ONLY), MlxAttention)
    assert isinstance(select_attention("auto", mx.float32, NO_NUMBA), MlxAttention)


def test_auto_takes_the_metal_kernel_where_there_is_metal() -> None:
    backend = select_attention("auto", mx.float32, MAC)
    assert isinstance(backend, KernelAttention) and backend.name == "metal"


def test_the_metal_kernel_reads_int8_and_q4_pages() -> None:
    for name in ("auto", "metal"):
        for storage in ("int8", "q4"):
            backend = select_attention(name, mx.float16, MAC, head_dims={64}, kv_storage=storage)
            assert isinstance(backend, RotatedPages) and isinstance(backend.inner, KernelAttention)
            assert backend.name == "metal"


def test_mlx_is_mlx_ops_everywhere_and_an_unknown_name_is_refused_listing_the_names() -> None:
    for platform in (CPU_ONLY, MAC):
        assert isinstance(select_attention("mlx", mx.float32, platform), MlxAttention)
    names = "must be one of auto, metal, cpu, mlx, got 'reference'"
    with pytest.raises(ConfigError, match=names):
        select_attention("reference", mx.float32, CPU_ONLY)  # the MLX-ops backend's old name: no alias
    with pytest.raises(ConfigError, match=names):
        EngineConfig(attention_backend="reference")  # type: ignore[arg-type]


def test_cpu_refuses_half_precision_and_a_missing_numba_with_a_reason() -> None:
    with pytest.raises(ConfigError, match="float32"):
        select_attention("cpu", mx.bfloat16, CPU_ONLY)
    with pytest.raises(ConfigError, match="numba"):
        select_attention("cpu", mx.float32, NO_NUMBA)


def test_metal_without_a_metal_device_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="Metal"):
        select_attention("metal", mx.float32, CPU_ONLY)


def test_an_unknown_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--attention-backend"):
        select_attention("portable", mx.float32, CPU_ONLY)


def test_a_head_dim_the_metal_kernel_lacks_takes_mlx_ops_on_a_mac_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="metalserve.engine"):
        backend = select_attention("auto", mx.bfloat16, MAC, head_dims={256, 512})  # gemma4: 512 on full layers
    assert isinstance(backend, MlxAttention)
    assert "head dims" in caplog.text and "[512]" in caplog.text
    assert isinstance(select_attention("auto", mx.bfloat16, MAC, head_dims={64, 128}), KernelAttention)
    with pytest.raises(ConfigError, match="Metal kernel takes head dims"):
        select_attention("metal", mx.bfloat16, MAC, head_dims={16})
