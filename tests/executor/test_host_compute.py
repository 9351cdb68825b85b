"""The host side of the CPU path: SwiGLU through numba and the vocabulary projection through NumPy."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from metalserve.executor.host.compute import HostCompute
from metalserve.executor.host.mlp import HostGatedMLP
from metalserve.executor.models.adapter import PagedModel
from metalserve.kernels.cpu.swiglu import swiglu
from tests.executor.tiny_models import tiny_model


def test_swiglu_matches_its_formula() -> None:
    rng = np.random.default_rng(0)
    gate_up = (rng.standard_normal((5, 12)) * 4).astype(np.float32)
    gate, up = gate_up[:, :6].astype(np.float64), gate_up[:, 6:].astype(np.float64)
    np.testing.assert_allclose(swiglu(gate_up), gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-6)


def test_swiglu_rejects_bad_shapes_and_dtypes() -> None:
    with pytest.raises(ValueError, match="2I"):
        swiglu(np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="float32"):
        swiglu(np.zeros((2, 4), np.float16))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_host_mlp_matches_mlx_lm(model_type: str) -> None:
    mlp = tiny_model(model_type).model.layers[0].mlp
    x = mx.random.normal((1, 7, mlp.gate_proj.weight.shape[1]), key=mx.random.key(1))
    want = mlp(x)
    host = HostGatedMLP(mlp)
    assert "gate_proj" not in host.inner and host.gate_up_proj is not None  # one fused matmul, weights held once
    np.testing.assert_allclose(np.array(host(x)), np.array(want), rtol=1e-5, atol=1e-5)
    # Half-precision activations take mlx-lm's own SwiGLU on the fused projection.
    half = np.array(host(x.astype(mx.float16)).astype(mx.float32))
    np.testing.assert_allclose(half, np.array(want), atol=3e-2)


def test_host_mlp_refuses_an_unknown_mlp() -> None:
    with pytest.raises(ValueError, match="not a known gated MLP"):
        HostGatedMLP(nn.Linear(4, 4))


def test_paged_model_moves_the_head_and_activation_to_the_host_only_when_asked() -> None:
    compute = HostCompute({})
    host = PagedModel(tiny_model("llama"), "llama", compute)
    plain = PagedModel(tiny_model("llama"), "llama")
    assert compute.head is not None and not hasattr(plain.compute, "head")
    assert isinstance(host.backbone.layers[0].mlp, HostGatedMLP)
    assert host.host_description() == "SwiGLU through numba in 2 layers, logits through NumPy"
    assert plain.host_description() == "nothing (all in MLX)"
    assert not isinstance(plain.backbone.layers[0].mlp, HostGatedMLP)
    hidden = mx.random.normal((3, plain.backbone.embed_tokens.weight.shape[1]), key=mx.random.key(2))
    got = compute.head_logits(np.array(hidden))
    np.testing.assert_allclose(got, np.array(plain.mlx_logits(hidden)), rtol=1e-5, atol=1e-5)


def test_quantized_head_and_mlp_stay_in_mlx() -> None:
    model = tiny_model("qwen2")
    nn.quantize(model, group_size=32, bits=4)
    compute = HostCompute({})
    paged = PagedModel(model, "qwen2", compute)
    assert compute.head is None
    assert not isinstance(paged.backbone.layers[0].mlp, HostGatedMLP)


def test_host_compute_is_chosen_for_the_host_families_only() -> None:
    from metalserve.executor.host import choose_compute
    from metalserve.executor.models.compute import MlxCompute
    from metalserve.executor.models.families import HOST_MODEL_TYPES, SUPPORTED_MODEL_TYPES
    from metalserve.platform import Platform

    cpu = Platform(on_cpu=True, metal=False, numba=True, blas="test")
    for model_type in ("qwen3", "gemma3_text", "phi3"):
        assert isinstance(choose_compute(cpu, {}, model_type), HostCompute)
    for model_type in set(SUPPORTED_MODEL_TYPES) - set(HOST_MODEL_TYPES):
        assert isinstance(choose_compute(cpu, {}, model_type), MlxCompute), model_type
    assert {"gemma3", "gemma2", "gpt_oss", "qwen3_moe"} <= set(SUPPORTED_MODEL_TYPES) - set(HOST_MODEL_TYPES)
