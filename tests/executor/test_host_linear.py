"""Projections that decode small steps from their stored codes (the CPU path), and MKL on fp32 otherwise."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import metalserve.kernels.cpu.packed_linear as packed_module
from metalserve.executor.host.compute import HostCompute
from metalserve.executor.host.linear import HostLinear, host_codes
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.models.fused_linear import fuse_linears
from metalserve.kernels.cpu.packed_codes import PackedCodes
from metalserve.loader.affine_codes import affine_codes
from metalserve.loader.weights_mode import dequantize_model
from metalserve.sampling_params import SamplingParams
from tests.executor.simple_driver import run_to_completion
from tests.executor.test_runner_golden import make_runner, mlx_lm_greedy, prompts_of
from tests.executor.tiny_models import tiny_model
from tests.loader.tiny_models import quantize_half_scales


def dequantized_tiny(
    model_type: str = "llama", keep_codes: bool = True, **overrides: object
) -> tuple[nn.Module, dict[str, PackedCodes]]:
    """A tiny model as the loader leaves a Q4 GGUF on the CPU: fp32 weights, and their codes by module path."""
    model = tiny_model(model_type, **overrides)
    quantize_half_scales(model)
    codes = dequantize_model(model, keep_codes=keep_codes)
    mx.eval(model.parameters())
    return model, codes


def test_dequantizing_keeps_codes_only_when_asked() -> None:
    (kept, codes), (_, dropped) = dequantized_tiny(), dequantized_tiny(keep_codes=False)
    q_proj = kept.model.layers[0].self_attn.q_proj
    found = host_codes(q_proj, [codes["model.layers.0.self_attn.q_proj"]])
    assert type(q_proj) is nn.Linear and found is not None and found[0].group_size == 32 and found[0].bits == 4
    np.testing.assert_array_equal(found[0].dense(), np.array(q_proj.weight))
    assert isinstance(codes["model.embed_tokens"], PackedCodes) and "lm_head" not in codes  # tied
    assert len(codes) == 1 + 2 * 7 and not dropped  # the embedding and 7 projections per layer
    assert not hasattr(q_proj, "affine_codes")  # returned, not attached
    assert host_codes(q_proj, [codes["model.layers.0.self_attn.k_proj"]]) is None  # another shape
    half = nn.Linear(64, 64, bias=False)
    half.set_dtype(mx.float16)
    assert host_codes(half, found) is None  # only float32 linears read codes
    assert host_codes(q_proj, [None]) is None


def test_fused_projections_fuse_their_codes() -> None:
    model, codes = dequantized_tiny()
    attn = model.model.layers[0].self_attn
    fused = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
    assert fused is not None
    parts = [codes[f"model.layers.0.self_attn.{n}"] for n in ("q_proj", "k_proj", "v_proj")]
    joined = host_codes(fused, parts)  # row blocks, not copied into one
    assert joined is not None and all(a is b for a, b in zip(joined, parts, strict=True))
    np.testing.assert_array_equal(np.concatenate([p.dense() for p in joined]), np.array(fused.weight))


def test_host_linear_reads_codes_for_small_steps_and_the_fp32_weights_for_large_ones() -> None:
    inner = nn.Linear(64, 8)
    other = nn.Linear(64, 8, bias=False)  # codes of different weights show which path ran
    other.weight = mx.random.normal((8, 64), key=mx.random.key(3))
    found = affine_codes(nn.QuantizedLinear.from_linear(other, group_size=32, bits=8))
    assert found is not None
    codes = PackedCodes.pack(found.codes, found.scales, found.biases, 8)
    layer = HostLinear(inner, [codes], max_tokens=4)
    small = mx.random.normal((1, 4, 64), key=mx.random.key(4))
    large = mx.random.normal((1, 5, 64), key=mx.random.key(5))
    from_codes = np.array(small[0]) @ codes.dense().T + np.array(inner.bias)
    np.testing.assert_allclose(np.array(layer(small))[0], from_codes, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(layer(large)), np.array(inner(large)), rtol=1e-6, atol=1e-6)
    # Half-precision activations go to MLX as they are.
    half = small.astype(mx.float16)
    np.testing.assert_array_equal(np.array(layer(half)), np.array(inner(half)))


def test_paged_model_wraps_every_projection_with_codes_and_the_head() -> None:
    compute = HostCompute(dequantized_tiny()[1])
    paged = PagedModel(dequantized_tiny()[0], "llama", compute)
    assert compute.linears == 8  # 2 layers x (qkv, o, gate+up, down)
    assert isinstance(paged.backbone.layers[1].self_attn.qkv_proj, HostLinear)
    assert isinstance(paged.backbone.layers[1].mlp.inner.down_proj, HostLinear)
    assert compute.head_codes is not None
    assert "8 projections from their stored codes" in paged.host_description()
    # 2 layers x (128x64 qkv + 64x64 o + 256x64 gate+up + 64x128 down) + 97x64 head: half a byte per weight
    # (4-bit codes, packed), and a float16 scale and bias per 32 of them.
    weights = 2 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128) + 97 * 64
    assert paged.host_bytes() == weights // 2 + weights // 32 * 4
    plain = PagedModel(dequantized_tiny()[0], "llama")
    assert plain.host_bytes() == 0 and plain.host_description() == "nothing (all in MLX)"
    hidden = mx.random.normal((3, 64), key=mx.random.key(6))
    got = compute.head_logits(np.array(hidden))
    np.testing.assert_allclose(got, np.array(plain.mlx_logits(hidden)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_decoding_from_codes_matches_mlx_lm(model_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = packed_module.packed_linear
    monkeypatch.setattr(packed_module, "packed_linear", lambda x, w: (calls.append(len(x)), real(x, w))[1])
    model, _ = dequantized_tiny(model_type)
    prompts = prompts_of([5, 40, 17, 1, 33, 9], model.args.vocab_size, seed=2)
    expected = [mlx_lm_greedy(model, p, 16) for p in prompts]
    fresh, codes = dequantized_tiny(model_type)
    runner = make_runner(fresh, model_type, attention="cpu", codes=codes)
    runner.model.compute.forward_on_host = None  # the MLX modules around the host linears (test_host_forward.py)
    for _, module in runner.model.model.named_modules():
        if isinstance(module, HostLinear):
            module.max_tokens = 8  # so the 105-token prefill takes MKL and the 6-token decode steps the codes
    got = run_to_completion(runner, prompts, [SamplingParams(temperature=0, max_tokens=16) for _ in prompts])
    assert got == expected
    assert calls and max(calls) <= 8  # the 105 prefill rows never reached the codes kernel
    assert calls.count(6) >= 4 * 2 * 15  # every decode step: 4 projections in 2 layers, 6 requests
