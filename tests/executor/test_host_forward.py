"""The whole decoder on the host for small steps of the CPU path: the same tokens as mlx-lm."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from metalserve.executor.attention.base import AttentionOptions
from metalserve.executor.attention.cpu import CpuAttention
from metalserve.executor.attention.rotation import RotatedPages
from metalserve.executor.host.compute import HostCompute
from metalserve.executor.host.forward import HostForward
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.runner import ModelRunner
from metalserve.kernels.cpu.layer_ops import rms_norm, rope_in_place, rope_inverse_frequencies
from metalserve.kvcache.specs import PageDtype
from metalserve.sampling_params import SamplingParams
from tests.executor.simple_driver import run_to_completion
from tests.executor.test_host_linear import dequantized_tiny
from tests.executor.test_runner_golden import make_runner, mlx_lm_greedy, prompts_of
from tests.executor.tiny_models import greedy_sampler


def _with_codes(model_type: str = "llama") -> tuple[nn.Module, str, HostCompute]:
    model, codes = dequantized_tiny(model_type)
    return model, model_type, HostCompute(codes)


@pytest.mark.parametrize(("dims", "base", "scale"), [(64, 100000.0, 1.0), (32, 10000.0, 0.5)])
def test_rope_matches_mlx(dims: int, base: float, scale: float) -> None:
    x = np.random.default_rng(0).standard_normal((5, 3, 64)).astype(np.float32)
    positions = np.array([0, 3, 100, 255, 1000])
    rope = nn.RoPE(dims, traditional=False, base=base, scale=scale)
    want = np.array(rope(mx.array(x)[:, :, None, :], offset=mx.array(positions))[:, :, 0, :])
    rope_in_place(x, positions, rope_inverse_frequencies(dims, base), scale)
    np.testing.assert_allclose(x, want, atol=1e-4)
    with pytest.raises(ValueError, match="contiguous"):
        rope_in_place(x[:, :, ::2], positions, rope_inverse_frequencies(dims, base))


def test_rms_norm_matches_mlx() -> None:
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((4, 2, 48)).astype(np.float32), rng.random(48).astype(np.float32)
    want = np.array(mx.fast.rms_norm(mx.array(x), mx.array(w), 1e-5))
    np.testing.assert_allclose(rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [1 << 30, 7])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_host_forward_decodes_like_mlx_lm(model_type: str, chunk_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    real = HostForward.__call__

    def counted(self: HostForward, ids: np.ndarray, ctx: object) -> np.ndarray:
        sizes.append(len(ids))
        return real(self, ids, ctx)  # type: ignore[arg-type]

    monkeypatch.setattr(HostForward, "__call__", counted)
    model, _ = dequantized_tiny(model_type)
    prompts = prompts_of([5, 40, 17, 1, 33, 9], model.args.vocab_size, seed=2)
    expected = [mlx_lm_greedy(model, p, 16) for p in prompts]
    fresh, codes = dequantized_tiny(model_type)
    runner = make_runner(fresh, model_type, attention="cpu", codes=codes)
    assert runner.model.compute.forward_on_host is not None
    got = run_to_completion(
        runner, prompts, [SamplingParams(temperature=0, max_tokens=16) for _ in prompts], chunk_size=chunk_size
    )
    assert got == expected
    # Every token ran on the host: the 105 prompt tokens, whole or in chunks after cached context, and the 15
    # sampled tokens of each request fed back.
    assert sum(sizes) == 105 + 6 * 15


def test_other_blocks_keep_the_mlx_modules() -> None:
    traditional, codes = dequantized_tiny()
    for layer in traditional.model.layers:
        layer.self_attn.rope = nn.RoPE(16, traditional=True)
    compute = HostCompute(codes)
    PagedModel(traditional, "llama", compute)
    assert compute.forward_on_host is None
    compute = HostCompute({})  # no stored codes: no host projections, so no host forward
    PagedModel(dequantized_tiny(keep_codes=False)[0], "llama", compute)
    assert compute.forward_on_host is None
    assert "the whole decoder" not in PagedModel(dequantized_tiny()[0], "llama").host_description()
    host = PagedModel(*_with_codes())
    assert "the whole decoder through numba" in host.host_description()


def test_layers_view_one_stack_of_codes() -> None:
    model = PagedModel(*_with_codes())
    assert model.compute.forward_on_host is not None
    stacked = model.compute.forward_on_host.weights
    for i, layer in enumerate(model.backbone.layers):
        pairs = [
            (layer.self_attn.qkv_proj, stacked.qkv),
            (layer.self_attn.inner.o_proj, stacked.o),
            (layer.mlp.gate_up_proj, stacked.gate_up),
            (layer.mlp.inner.down_proj, stacked.down),
        ]
        for linear, segments in pairs:
            first, last = segments.layer_first[i], segments.layer_first[i + 1]
            assert last - first == len(linear.codes)  # one segment per row block (q, k, v; gate, up)
            for part, s in zip(linear.codes, range(first, last), strict=True):
                assert np.shares_memory(part.codes, segments.data[s])  # a view, not a copy
            dense = np.concatenate([p.dense() for p in linear.codes])
            np.testing.assert_array_equal(dense, np.array(linear.inner.weight))
    # Held once: the host bytes are the layers' codes (and the head's).
    parts = [p for layer in model.backbone.layers for lin in _linears(layer) for p in lin.codes]
    head = model.compute.head_codes
    head_bytes = 0 if head is None else sum(p.nbytes for p in head.parts)
    assert model.host_bytes() == sum(p.nbytes for p in parts) + head_bytes


def _linears(layer: nn.Module) -> list[nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.inner.o_proj, mlp.gate_up_proj, mlp.inner.down_proj]


def test_layers_that_differ_keep_the_mlx_modules() -> None:
    model = PagedModel(*_with_codes())
    assert HostForward.build(model.backbone) is not None
    attn = model.backbone.layers[1].self_attn
    attn.options = AttentionOptions(scale=attn.options.scale, softcap=30.0)  # one layer unlike the others
    assert HostForward.build(model.backbone) is None


def test_decoder_cache_is_keyed_on_the_kernels_it_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """numba keys its cache on a function's bytecode and closure only; each decoder function closes over a
    digest of the kernel files it calls, so an edit to one of them is a cache miss, not a stale kernel."""
    from metalserve.kernels.cpu import attention as cpu_attention
    from metalserve.kernels.cpu import decoder as cpu_decoder

    digest = cpu_decoder.kernel_sources_digest()
    dispatchers = [cpu_decoder._linear, cpu_decoder._head_norm, cpu_decoder._attention, cpu_decoder._decoder_layers]
    for dispatcher in dispatchers:
        assert [cell.cell_contents for cell in dispatcher.py_func.__closure__] == [digest]
    edited = tmp_path / "attention.py"
    edited.write_bytes(Path(str(cpu_attention.__file__)).read_bytes() + b"# edited\n")
    monkeypatch.setattr(cpu_attention, "__file__", str(edited))
    assert cpu_decoder.kernel_sources_digest() != digest


WIDE_HEADS = {"hidden_size": 128, "head_dim": 32}  # q4 pages take groups of 32 channels


def _quantized_runner(model_type: str, storage: str, host: bool) -> ModelRunner:
    """The CPU path over `storage` KV pages (Hadamard-rotated, as the engine builds it); `host` False: the
    host decoder removed, so every step runs the MLX modules and the per-layer quantized kernel."""
    model, codes = dequantized_tiny(model_type, **WIDE_HEADS)
    paged = PagedModel(model, model_type, HostCompute(codes))
    if not host:
        paged.compute.forward_on_host = None
    spec = paged.get_kv_cache_spec(PageDtype(storage=storage), 16, 128)
    return ModelRunner(paged, spec, sampler=greedy_sampler, backend=RotatedPages(CpuAttention()))


@pytest.mark.parametrize("storage", ["int8", "q4", "k8v4"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_host_forward_reads_quantized_pages(model_type: str, storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 / q4 / k8v4 (int8 K, q4 V) pages through the one-call decoder: the tokens of the per-layer route
    over the same pages."""
    calls: list[int] = []
    real = HostForward.__call__

    def counted(self: HostForward, ids: np.ndarray, ctx: object) -> np.ndarray:
        calls.append(len(ids))
        return real(self, ids, ctx)  # type: ignore[arg-type]

    monkeypatch.setattr(HostForward, "__call__", counted)
    prompts = prompts_of([5, 40, 17, 1, 33, 9], 97, seed=5)  # seed 4: a 0.013 logit tie flips with the rounding
    params = [SamplingParams(temperature=0, max_tokens=16) for _ in prompts]
    expected = run_to_completion(_quantized_runner(model_type, storage, host=False), prompts, params, chunk_size=7)
    assert not calls
    got = run_to_completion(_quantized_runner(model_type, storage, host=True), prompts, params, chunk_size=7)
    assert got == expected
    assert sum(calls) == 105 + 6 * 15  # every token through the host decoder
