"""Adapters on the CPU fast path: a GGUF kept in its codes runs every step of a batch that mixes adapters,
scales and the base model in the one-call numba decoder, and answers as the MLX route over the same file,
as the fast-path model's own MLX modules (the steps the decoder does not take), and as mlx-lm's model with
each adapter fused into the decoded weights."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.nn as nn
import pytest
from mlx.utils import tree_unflatten
from mlx_lm.tuner.utils import load_adapters

from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.executor.host.compute import HostCompute
from metalserve.executor.host.forward import HostForward
from metalserve.lora.fused import FusedLoraLinear
from metalserve.lora.request import LoraRequest
from metalserve.platform import current_platform
from metalserve.serving import build as build_module
from metalserve.serving.build import build_engine_core
from tests.executor.test_runner_golden import prompts_of
from tests.lora.test_lora_engine import NUM_TOKENS, reference, run
from tests.lora.tiny_adapters import ALL_KEYS, make_mlx_lm_adapter

pytestmark = pytest.mark.skipif(
    not current_platform().host_compute, reason="the CPU fast path needs numba on MLX's CPU"
)

TOLERANCE = 1e-3  # codes against their decoded fp32 weights: accumulation order only
ARCHS = {"llama": "llama", "qwen3": "qwen3"}  # GGUF arch -> mlx-lm model type


def _shape() -> dict[str, Any]:
    from tests.loader.gguf_arch_models import FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS

    return {
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
    }


def _fused(arch: str, weights: dict, folder: Path) -> nn.Module:
    from tests.loader.gguf_arch_models import reference_model

    model = reference_model(arch, weights)
    load_adapters(model, str(folder))
    model.update_modules(tree_unflatten([(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]))
    return model


class _Spy:
    """Counts the host decoder's calls, and those whose step had adapter tokens."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = self.with_adapters = 0
        original = HostForward.__call__

        def spy(host: HostForward, token_ids, ctx):  # noqa: ANN001, ANN202
            self.calls += 1
            self.with_adapters += ctx.lora is not None and len(ctx.lora.host.rows) > 0
            return original(host, token_ids, ctx)

        monkeypatch.setattr(HostForward, "__call__", spy)


def _jobs(core: EngineCore, prompts: list[list[int]]) -> dict[str, tuple[list[int], LoraRequest | None]]:
    loras = core.lora_requests()
    jobs: dict[str, tuple[list[int], LoraRequest | None]] = {}
    for i, prompt in enumerate(prompts):
        jobs |= {f"a{i}": (prompt, loras["a"]), f"b{i}": (prompt, loras["b"]), f"base{i}": (prompt, None)}
        jobs[f"half{i}"] = (prompt, replace(loras["a"], scale=0.5))
    return jobs


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_mixed_batch_on_the_fast_path_equals_the_mlx_route_and_the_fused_models(
    tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from metalserve.loader import load_model
    from tests.loader.gguf_arch_models import reference_model, write_arch_gguf
    from tests.loader.gguf_blocks import T

    model_type = ARCHS[arch]
    path = tmp_path / f"{arch}.gguf"
    weights = write_arch_gguf(path, arch, T.Q8_0)
    a = make_mlx_lm_adapter(tmp_path / "a", model_type, seed=3, rank=4, scale=2.0, **_shape())
    b = make_mlx_lm_adapter(tmp_path / "b", model_type, seed=5, rank=8, scale=1.0, keys=ALL_KEYS, **_shape())
    half = make_mlx_lm_adapter(tmp_path / "half", model_type, seed=3, rank=4, scale=1.0, **_shape())
    prompts = prompts_of([11, 29], 200, seed=4)
    expected = {}
    for i, prompt in enumerate(prompts):
        for name, folder in (("a", a), ("b", b), ("half", half)):
            expected[f"{name}{i}"] = reference(_fused(arch, weights, folder), prompt, NUM_TOKENS)
        expected[f"base{i}"] = reference(reference_model(arch, weights), prompt, NUM_TOKENS)
    config = EngineConfig(
        kv_cache_memory=1 << 23, block_size=8, enable_lora=True, lora_modules=(("a", str(a)), ("b", str(b)))
    )
    spy = _Spy(monkeypatch)
    fast = build_engine_core(config, load_model(str(path)))
    spy.calls = 0  # the start-up's warm-up step
    host = getattr(fast.runner.model.compute, "forward_on_host", None)
    assert host is not None and host.lora.qkv.a.shape[:2] == (2, config.max_loras)
    on_fast = run(fast, _jobs(fast, prompts))
    assert spy.with_adapters > 0 and spy.calls == spy.with_adapters  # every step of the batch took the decoder
    # The fast-path model's own MLX route (FusedLoraLinear on the fused projections), for the steps the
    # decoder does not take: every step here.
    monkeypatch.setattr(HostCompute, "host_job", lambda *_: None)
    fused_mlx = build_engine_core(config, load_model(str(path)))
    on_fused_mlx = run(fused_mlx, _jobs(fused_mlx, prompts))
    assert any(isinstance(m, FusedLoraLinear) for _, m in fused_mlx.runner.model.model.named_modules())
    monkeypatch.setattr(build_module, "host_compute_applies", lambda *_: False)  # the MLX route, same file
    mlx = build_engine_core(config, load_model(str(path)))
    spy.calls = spy.with_adapters  # whatever the other builds' warm-up steps added
    assert getattr(mlx.runner.model.compute, "forward_on_host", None) is None
    on_mlx = run(mlx, _jobs(mlx, prompts))
    assert spy.calls == spy.with_adapters  # the MLX route never called the decoder
    for rid, (tokens, logprobs) in on_mlx.items():
        for got in (on_fast, on_fused_mlx):
            assert got[rid][0] == tokens, rid
            assert max(abs(x - y) for x, y in zip(got[rid][1], logprobs, strict=True)) < TOLERANCE, rid
    for rid, (tokens, logprobs) in expected.items():  # mlx-lm: the adapter fused into the decoded weights
        assert on_fast[rid][0] == tokens, rid
        assert max(abs(x - y) for x, y in zip(on_fast[rid][1], logprobs, strict=True)) < TOLERANCE, rid
    worst = max(abs(x - y) for rid, (_, lps) in expected.items() for x, y in zip(on_fast[rid][1], lps, strict=True))
    route = max(abs(x - y) for rid, (_, lps) in on_mlx.items() for x, y in zip(on_fast[rid][1], lps, strict=True))
    print(f"{arch} fast path: max |logprob delta| {worst:.1e} against mlx-lm fused, {route:.1e} against the MLX route")
    assert len({tuple(on_fast[f"{n}0"][0]) for n in ("a", "b", "half", "base")}) == 4  # each one differs
