"""The golden harness for hybrid models: mlx-lm's own generation against the real engine."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.executor.models.families import kv_cache_spec
from metalserve.loader import LoadedModel
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from tests.models.golden import reference
from tests.models.hybrid_tiny import VOCAB, tiny_hybrid

BLOCK_SIZE = 16
LOGPROB_TOL = 1e-2


@dataclass
class Generated:
    tokens: list[int]
    logprobs: list[float]


def prompts_of(lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in lengths]


def mlx_lm_greedy(model_type: str, prompt: list[int], n: int, bits: int | None = None) -> Generated:
    """mlx-lm's reference: a fresh copy of the tiny model, its own call with its own prompt cache."""
    ref = reference(tiny_hybrid(model_type, bits=bits), prompt, n)
    return Generated(ref.tokens, ref.logprobs)


def bytes_per_block(loaded: LoadedModel) -> int:
    """One block id: the attention layers' K/V of BLOCK_SIZE tokens and every recurrent layer's state."""
    return kv_cache_spec(loaded, BLOCK_SIZE).bytes_per_block


def engine(
    loaded: LoadedModel,
    budget: int = 512,
    num_blocks: int = 256,
    max_model_len: int = 1024,
    caching: bool = True,
    attention: str = "auto",
) -> EngineCore:
    """The real engine with a pool of exactly `num_blocks` blocks (the null block included); `attention`
    "auto" is the numba CPU kernel here, "mlx" the MLX-ops backend."""
    config = EngineConfig(
        kv_cache_memory=bytes_per_block(loaded) * num_blocks,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        max_num_seqs=8,
        enable_prefix_caching=caching,
        attention_backend=attention,
    )
    core = build_engine_core(config, loaded)
    assert core.scheduler.kv.pool.num_blocks == num_blocks
    return core


def serve(core: EngineCore, prompts: list[list[int]], n: int | list[int], tag: str = "r") -> list[Generated]:
    """Add every prompt (in order), then step until all are done; `n`: tokens to generate (per prompt)."""
    counts = n if isinstance(n, list) else [n] * len(prompts)
    for i, (p, k) in enumerate(zip(prompts, counts, strict=True)):
        params = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True, logprobs=0)
        core.add_request(Request(f"{tag}{i}", p, params))
    got = {f"{tag}{i}": Generated([], []) for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for out in core.step():
            got[out.request_id].tokens += out.new_token_ids
            got[out.request_id].logprobs += [lp.logprob for lp in out.new_logprobs or []]
    return [got[f"{tag}{i}"] for i in range(len(prompts))]


def assert_matches(got: Generated, expected: Generated) -> None:
    assert got.tokens == expected.tokens
    assert np.allclose(got.logprobs, expected.logprobs, atol=LOGPROB_TOL), (got.logprobs, expected.logprobs)
