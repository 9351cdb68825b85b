"""Greedy tokens of the default model: the emulated Metal kernels and the portable path agree exactly.

A short run (the emulator is slow): a mixed batch of prompts, chunked so that steps mix prefill chunks
over cached prefixes with decodes, a few tokens each.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from metalserve.executor.attention import mlx_ops
from metalserve.executor.attention.metal import KernelAttention
from metalserve.executor.host import paged_model
from metalserve.executor.models.families import kv_cache_spec
from metalserve.executor.runner import ModelRunner
from metalserve.executor.sampler import Sampler
from metalserve.kernels.metal.launch import KernelLaunch
from metalserve.loader import load_model
from metalserve.platform import current_platform
from metalserve.sampling_params import SamplingParams
from tests.executor.simple_driver import run_to_completion
from tools.msl_emulator import emulate, emulated
from tools.msl_emulator.emulated import emulated_paged_attention

pytestmark = pytest.mark.slow
LENGTHS = [9, 30, 3, 17]
NUM_TOKENS = 6
CHUNK = 12


def test_emulated_kernels_give_the_portable_paths_greedy_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulated path makes the entry point's own choice: the tiled kernel for every step that has a
    prefill chunk, the decode kernel for all-decode steps (the kernel cases run each kernel on decodes)."""
    launched: Counter[str] = Counter()

    def recording(launch: KernelLaunch) -> list[mx.array]:
        launched[launch.name] += 1
        return emulate(launch)

    monkeypatch.setattr(emulated, "emulate", recording)
    loaded = load_model(None)
    rng = np.random.default_rng(5)
    text = loaded.tokenizer.encode(" ".join(["a quiet river runs past the old mill by the town"] * 6))
    prompts = [text[int(o) : int(o) + n] for o, n in zip(rng.integers(0, 15, len(LENGTHS)), LENGTHS, strict=True)]
    model = paged_model(loaded, current_platform())
    spec = kv_cache_spec(loaded, 16, num_blocks=32)
    outputs = {}
    for name, fn in (("portable", mlx_ops.paged_attention), ("emulated", emulated_paged_attention)):
        runner = ModelRunner(model, spec, sampler=Sampler(0), backend=KernelAttention(fn, name, name))
        params = [SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True) for _ in prompts]
        outputs[name] = run_to_completion(runner, prompts, params, chunk_size=CHUNK)
    assert all(len(o) == NUM_TOKENS for o in outputs["portable"])
    assert outputs["emulated"] == outputs["portable"]
    assert launched["paged_attention_tiled"] > 0 and launched["paged_attention"] > 0


def dequantizing_reference(
    q: mx.array, k: mx.array, v: mx.array, *args: mx.array, storage: str, **kwargs: object
) -> mx.array:
    """The portable path on the Metal backend's quantized pools, dequantized whole (metal._dequantized)."""
    from metalserve.executor.attention.metal import LayerKV, _dequantized
    from metalserve.kvcache.specs import PageDtype

    parts = {n: kwargs.pop(n) for n in ("k_scales", "v_scales", "k_biases", "v_biases") if n in kwargs}
    cache = _dequantized(LayerKV(k, v, **parts, page=PageDtype(storage=storage)), q.dtype)  # type: ignore[arg-type]
    return mlx_ops.paged_attention(q, cache.k, cache.v, *args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("storage", ["int8", "q4"])
def test_emulated_kernels_on_quantized_pages_attend_like_the_portable_path(
    storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--kv-cache-dtype int8 / q4 on the Metal backend (its pools and writes) in the default model's
    steps: every attention call of the emulated kernels equals the portable path on the same dequantized
    pages. (Greedy tokens are not compared: int8 meets a near-tie, a 5e-6 attention difference flipping
    one token, in these prompts.)"""
    from functools import partial

    launched: Counter[str] = Counter()

    def recording(launch: KernelLaunch) -> list[mx.array]:
        launched[launch.name] += 1
        return emulate(launch)

    monkeypatch.setattr(emulated, "emulate", recording)
    reference_fn = partial(dequantizing_reference, storage=storage)
    differences: list[float] = []

    def compared(*args: mx.array, **kwargs: object) -> mx.array:
        out = emulated_paged_attention(*args, **kwargs)  # type: ignore[arg-type]
        differences.append(float(mx.max(mx.abs(out - reference_fn(*args, **kwargs)))))
        return out

    loaded = load_model(None)
    text = loaded.tokenizer.encode(" ".join(["a quiet river runs past the old mill by the town"] * 4))
    prompts = [text[:9], text[5:35], text[2:19]]
    model = paged_model(loaded, current_platform())
    spec = kv_cache_spec(loaded, 16, storage, num_blocks=32)  # type: ignore[arg-type]
    runner = ModelRunner(model, spec, sampler=Sampler(0), backend=KernelAttention(compared, "emulated", "emulated"))
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True) for _ in prompts]
    outputs = run_to_completion(runner, prompts, params, chunk_size=CHUNK)
    assert all(len(o) == 4 for o in outputs)
    assert differences and max(differences) < 2e-5
    assert launched["paged_attention_tiled"] > 0 and launched["paged_attention"] > 0
