"""gemma3 (text) and phi3 on the one-call host decoder: served by the real engine on the CPU backend, every
token through the host decoder, against mlx-lm's own generation on the same (dequantized) weights.

gemma3 brings sandwich norms with `1 + weight`, the bfloat16-rounded embedding scale, a GELU-tanh gate,
q/k norms, per-layer RoPE bases and sliding-window layers in groups of their own (so each layer reads its
group's block table); phi3 its fused qkv / gate_up projections and SuScaledRoPE over half the head dim
(frequencies from long factors, an input scale). Safetensors-style: fp32 weights beside their codes; GGUF:
the codes alone (`--weights auto`).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from metalserve.executor.host.forward import HostForward
from metalserve.executor.host.layers import HostRope
from metalserve.loader import load_model
from metalserve.loader.codes_linear import CodesLinear
from metalserve.loader.weights_mode import dequantize_model
from tests.loader.gguf_arch_models import reference_model, write_arch_gguf
from tests.loader.tiny_models import quantize_half_scales
from tests.models.archs import build
from tests.models.golden import engine, loaded_of, prompts, reference, serve

FAMILIES = ["gemma3_text", "phi3"]


@pytest.fixture
def host_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The tokens of each step the host decoder ran."""
    calls: list[int] = []
    real = HostForward.__call__

    def counted(self: HostForward, ids: np.ndarray, ctx: object) -> np.ndarray:
        calls.append(len(ids))
        return real(self, ids, ctx)  # type: ignore[arg-type]

    monkeypatch.setattr(HostForward, "__call__", counted)
    return calls


def _dequantized(arch: str) -> tuple[nn.Module, dict]:
    model = build(arch)
    quantize_half_scales(model)
    codes = dequantize_model(model, keep_codes=True)
    mx.eval(model.parameters())
    return model, codes


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_decodes_like_mlx_lm_through_the_host_decoder(arch: str, host_calls: list[int]) -> None:
    model, codes = _dequantized(arch)
    batch = prompts([11, 40, 3], 256, seed=6)
    want = [reference(model, p) for p in batch]
    loaded = loaded_of(model, arch)
    loaded.codes = codes
    core = engine(model, arch, backend="cpu", loaded=loaded)
    host_calls.clear()  # the start-up's warm-up step
    got = serve(core, batch)
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-3)
    assert max(abs(lp) for w in want for lp in w.logprobs) > 0.05  # not a model that is sure of everything
    assert sum(host_calls) == 54 + 3 * 11  # every prompt token and every fed-back token


def test_phi3_rope_is_scaled() -> None:
    """The phi3 case above exercises SuScaledRoPE's input scale and non-uniform factors, not a plain RoPE."""
    rope = HostRope.of(build("phi3").model.layers[0].self_attn.rope)
    assert rope is not None and rope.mscale > 1.01 and len(rope.inv_freq) == 4


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_gguf_family_keeps_its_codes_and_takes_the_host_decoder(
    tmp_path: Path, arch: str, host_calls: list[int]
) -> None:
    path = tmp_path / f"{arch}.gguf"
    ref = reference_model(arch, write_arch_gguf(path, arch, T.Q4_0))
    loaded = load_model(str(path))
    assert "kept in its codes" in loaded.weights_desc, loaded.weights_desc
    assert any(isinstance(m, CodesLinear) for _, m in loaded.model.named_modules())
    batch = prompts([5, 40, 17], ref.args.vocab_size, seed=4)
    core = engine(loaded.model, loaded.model_type, backend="cpu", loaded=loaded)
    host_calls.clear()  # the start-up's warm-up step
    got = serve(core, batch)
    for g, w in zip(got, [reference(ref, p) for p in batch], strict=True):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-3)
    assert sum(host_calls) == 62 + 3 * 11
