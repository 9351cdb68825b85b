"""The shared golden harness: a tiny mlx-lm model served by the real engine against mlx-lm's own generation.

`reference` is mlx-lm's plain loop over `model(x, cache=make_prompt_cache(model))` (the whole prompt in
one call, then one token at a time), greedy, with each chosen token's log-probability. `serve` runs
prompts through `EngineCore` (the real scheduler, KV manager with the model's layer groups, runner and
sampler) and returns the same, plus how many prompt tokens came from the prefix cache. `check` compares:
tokens identical, log-probabilities within `LOGPROB_TOL`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.loader import LoadedModel
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core

LOGPROB_TOL = 1e-2
SHORT, LONG = 11, 300  # prompt lengths: one within a block, one crossing a 16-token window many times
NEW_TOKENS = 12


@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]
    cached_tokens: int = 0


def prompts(lengths: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def reference(model: nn.Module, prompt: list[int], n: int = NEW_TOKENS) -> Generation:
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    out = Generation([], [])
    for _ in range(n):
        logprobs = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32))
        token = int(mx.argmax(logprobs).item())
        out.tokens.append(token)
        out.logprobs.append(float(logprobs[token].item()))
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return out


def loaded_of(model: nn.Module, model_type: str, max_model_len: int = 1024) -> LoadedModel:
    """The LoadedModel the loader would hand over for this in-memory model (float32, no tokenizer)."""
    return LoadedModel(
        model=model,
        tokenizer=None,
        model_type=model_type,
        config={},
        max_model_len=max_model_len,  # type: ignore[arg-type]
        eos_token_ids=frozenset(),
        chat_template=None,
        source="tiny",
        weights_desc="fp32",
        blas_desc="-",
    )


def engine(
    model: nn.Module,
    model_type: str | None = None,
    *,
    budget: int = 2048,
    backend: str = "auto",
    loaded: LoadedModel | None = None,
    **overrides: Any,
) -> EngineCore:
    """The real engine over `model` (its own `model_type` by default), pool sized by --kv-cache-memory.
    `loaded`: what the loader would hand over, when more than the model (a vision model's tower);
    `overrides`: more EngineConfig fields."""
    fields: dict[str, Any] = {
        "kv_cache_memory": 1 << 24,
        "block_size": 16,
        "max_num_batched_tokens": budget,
        "max_num_seqs": 8,
        "attention_backend": backend,
        "enable_prefix_caching": True,
    }
    config = EngineConfig(**{**fields, **overrides})
    return build_engine_core(config, loaded or loaded_of(model, model_type or model.model_type))


def serve(core: EngineCore, batch: list[list[int]], n: int = NEW_TOKENS, tag: str = "r") -> list[Generation]:
    """Run `batch` together to completion (greedy, `n` tokens each, logprobs of the chosen tokens)."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    ids = [f"{tag}{i}" for i in range(len(batch))]
    for rid, prompt in zip(ids, batch, strict=True):
        core.add_request(Request(rid, list(prompt), params))
    got = {rid: Generation([], []) for rid in ids}
    while core.has_unfinished_requests():
        for out in core.step():
            gen = got[out.request_id]
            gen.tokens += out.new_token_ids
            gen.logprobs += [lp.logprob for lp in out.new_logprobs or []]
            gen.cached_tokens = max(gen.cached_tokens, out.num_cached_tokens)
    return [got[rid] for rid in ids]


def check(got: Generation, want: Generation) -> None:
    assert got.tokens == want.tokens
    assert len(got.logprobs) == len(want.logprobs)
    assert np.allclose(got.logprobs, want.logprobs, atol=LOGPROB_TOL), (got.logprobs, want.logprobs)
