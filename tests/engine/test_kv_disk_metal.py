"""The disk tier with the Metal backend's quantized pages (--attention-backend metal --kv-cache-dtype int8):
no longer refused at start-up, and a restart serves the prefix from disk with the tokens of a cold run.

There is no Metal device here: the Platform is faked as a Mac and the Metal backend (KernelAttention, its
own slot-major pools of codes and scales, written by its own forward) runs with a kernel that every launch
refuses, so attention takes the backend's MLX-ops fallback over its dequantized pools. The pages the disk
tier stores are the Metal backend's; only the attention arithmetic is not the GPU's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from metalserve.engine.core import EngineCore
from metalserve.executor.attention.metal import KernelAttention, LayerKV
from metalserve.executor.attention.rotation import RotatedPages
from metalserve.kernels.metal.guard import LaunchRefused
from metalserve.kvcache.connector.disk_store import SUFFIX, decode_block
from metalserve.platform import Platform
from tests.engine.test_kv_disk import PROMPT, generate, make_core

MAC = Platform(on_cpu=False, metal=True, numba=True, blas="test", metal_memory=1 << 34)


def refusing_kernel(*args: Any, **kwargs: Any) -> mx.array:
    raise LaunchRefused("no Metal device in this test", first=False)


def fake_a_mac(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built from here on see a Mac and get the Metal backend with `refusing_kernel`."""
    monkeypatch.setattr("metalserve.serving.build.current_platform", lambda: MAC)
    monkeypatch.setattr("metalserve.executor.attention.select.metal_kernel_problem", lambda head_dims: None)
    monkeypatch.setattr("metalserve.executor.attention.metal.metal_attention", lambda: KernelAttention(refusing_kernel))


@pytest.fixture
def fake_mac(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_a_mac(monkeypatch)


def metal_core(directory: Path | None) -> EngineCore:
    core = make_core(directory, kv_dtype="int8", attention_backend="metal")
    backend = core.runner.backend
    assert isinstance(backend, RotatedPages) and isinstance(backend.inner, KernelAttention)
    assert all(isinstance(c, LayerKV) and c.k_scales is not None for c in core.runner.kv)
    return core


@pytest.mark.usefixtures("fake_mac")
def test_the_metal_backends_int8_pages_come_back_from_disk_after_a_restart(tmp_path: Path) -> None:
    cold_core = metal_core(None)
    cold = generate(cold_core, [PROMPT], 8)
    cold_core.close()
    first = metal_core(tmp_path)  # start-up used to refuse: "keeps pools the disk tier cannot read"
    assert generate(first, [PROMPT], 8) == cold
    first.close()
    files = sorted(tmp_path.glob("*" + SUFFIX))
    assert len(files) == 5  # 40 prompt + 7 generated tokens: 5 full blocks of 8
    tensors = decode_block(files[0].read_bytes(), files[0].name[:64])
    assert tensors is not None
    assert str(tensors["kv.0"].dtype) == "int8" and tensors["kv.0"].shape == (2, 2, 8, 16)
    assert str(tensors["kv.0.scales"].dtype) == "float16" and tensors["kv.0.scales"].shape == (2, 2, 8, 1)
    assert "kv.0.biases" not in tensors
    second = metal_core(tmp_path)
    assert generate(second, [PROMPT], 8) == cold
    stats = second.make_stats().connector
    assert stats is not None and stats.hits == 32 and stats.bytes_loaded > 0
    second.close()


@pytest.mark.usefixtures("fake_mac")
def test_a_directory_the_metal_backend_wrote_serves_the_mlx_ops_backend(tmp_path: Path) -> None:
    """One format for both backends: the same storage key, the same tensors, the same meaning."""
    writer = metal_core(tmp_path)
    generate(writer, [PROMPT], 8)
    writer.close()
    cold_core = make_core(None, kv_dtype="int8", attention_backend="mlx")
    cold = generate(cold_core, [PROMPT], 8)
    cold_core.close()
    reader = make_core(tmp_path, kv_dtype="int8", attention_backend="mlx")
    assert not isinstance(getattr(reader.runner.backend, "inner", None), KernelAttention)
    assert generate(reader, [PROMPT], 8) == cold
    stats = reader.make_stats().connector
    assert stats is not None and stats.hits == 32
    reader.close()
