"""The packed paged runner must reproduce mlx-lm's own greedy generation token for token."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from metalserve.executor.attention.cpu import CpuAttention
from metalserve.executor.host.compute import HostCompute
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.runner import ModelRunner
from metalserve.kvcache.specs import PageDtype
from metalserve.sampling_params import SamplingParams
from tests.executor.simple_driver import run_to_completion
from tests.executor.tiny_models import greedy_sampler, tiny_model

NUM_TOKENS = 32


def mlx_lm_greedy(model, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's reference: its own model call with its contiguous KV cache."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return out


# MLX ops alone, and the CPU path: attention through the numba kernel, MLP activation and vocabulary
# projection on the host.
ATTENTION = ["mlx", "cpu"]


def make_runner(
    model, model_type: str, num_blocks: int = 128, block_size: int = 16, attention: str = "mlx", codes=None
) -> ModelRunner:
    """`attention` "cpu": the CPU backend with host compute (reading `codes`, the loader's stored codes)."""
    if attention == "cpu":
        paged = PagedModel(model, model_type, HostCompute(codes or {}))
        spec = paged.get_kv_cache_spec(PageDtype(), block_size, num_blocks)
        return ModelRunner(paged, spec, sampler=greedy_sampler, backend=CpuAttention())
    paged = PagedModel(model, model_type)
    return ModelRunner(paged, paged.get_kv_cache_spec(PageDtype(), block_size, num_blocks), sampler=greedy_sampler)


def prompts_of(lengths: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_single_request_matches_mlx_lm(model_type: str, attention: str) -> None:
    model = tiny_model(model_type)
    (prompt,) = prompts_of([21], model.args.vocab_size)
    expected = mlx_lm_greedy(model, prompt, NUM_TOKENS)
    runner = make_runner(tiny_model(model_type), model_type, attention=attention)
    (got,) = run_to_completion(runner, [prompt], [SamplingParams(temperature=0, max_tokens=NUM_TOKENS)])
    assert got == expected


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("chunk_size", [1 << 30, 7])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_eight_mixed_requests_in_the_same_steps(chunk_size: int, block_size: int, attention: str) -> None:
    model = tiny_model("llama")
    prompts = prompts_of([5, 40, 17, 1, 33, 64, 9, 26], model.args.vocab_size, seed=2)
    expected = [mlx_lm_greedy(model, p, NUM_TOKENS) for p in prompts]
    runner = make_runner(model, "llama", block_size=block_size, attention=attention)
    params = [SamplingParams(temperature=0, max_tokens=NUM_TOKENS) for _ in prompts]
    got = run_to_completion(runner, prompts, params, chunk_size=chunk_size)
    assert got == expected


@pytest.mark.parametrize("attention", ATTENTION)
def test_block_tables_need_not_be_contiguous(attention: str) -> None:
    """Requests whose pages interleave in the pool still read only their own K/V."""
    model = tiny_model("llama")
    prompts = prompts_of([30, 30], model.args.vocab_size, seed=3)
    expected = [mlx_lm_greedy(model, p, 8) for p in prompts]
    runner = make_runner(model, "llama", block_size=8, attention=attention)
    params = [SamplingParams(temperature=0, max_tokens=8) for _ in prompts]
    # chunk_size 8 = block size: the two requests take alternating blocks.
    assert run_to_completion(runner, prompts, params, chunk_size=8) == expected


def test_quantized_weights_fuse_and_match_mlx_lm() -> None:
    """A 4-bit model keeps its quantized layout through the fused q/k/v projection."""
    import mlx.nn as nn

    model = tiny_model("qwen2")
    nn.quantize(model, group_size=32, bits=4)
    (prompt,) = prompts_of([19], model.args.vocab_size, seed=4)
    expected = mlx_lm_greedy(model, prompt, 16)
    runner = make_runner(model, "qwen2")
    fused = runner.model.backbone.layers[0].self_attn.qkv_proj
    assert isinstance(fused, nn.QuantizedLinear)
    (got,) = run_to_completion(runner, [prompt], [SamplingParams(temperature=0, max_tokens=16)])
    assert got == expected
