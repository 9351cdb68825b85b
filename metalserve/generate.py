"""`metalserve generate`: run prompts or chat messages through the runner with a simple driver.

It exercises the model runner end to end without the scheduler; the engine replaces its driver.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from metalserve.executor.attention.select import select_attention
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.runner import KVCacheSpec, ModelRunner
from metalserve.executor.sampler import Sampler
from metalserve.executor.simple_driver import run_to_completion
from metalserve.loader import LoadedModel
from metalserve.platform import current_platform
from metalserve.sampling_params import SamplingParams


@dataclass
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str


def encode_chat(loaded: LoadedModel, user_message: str) -> list[int]:
    messages = [{"role": "user", "content": user_message}]
    text = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template already wrote the special tokens (BOS, role markers): encode it as is.
    return list(loaded.tokenizer.encode(text, add_special_tokens=False))


def generate(
    loaded: LoadedModel,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    block_size: int = 16,
    chunk_size: int = 512,
    seed: int = 0,
) -> list[Generation]:
    """Run all prompts together, prefill in chunks of `chunk_size`, until each stops."""
    max_new = params.max_tokens or 256
    longest = max(len(p) for p in prompts) + max_new
    if longest > loaded.max_model_len:
        raise ValueError(f"a prompt plus max_tokens is {longest} tokens, more than the context {loaded.max_model_len}")
    blocks_each = -(-longest // block_size)
    spec = KVCacheSpec.for_model(loaded, block_size, blocks_each * len(prompts))
    platform = current_platform()
    runner = ModelRunner(
        PagedModel.from_loaded(loaded, platform),
        spec,
        eos_token_ids=loaded.eos_token_ids,
        sampler=Sampler(seed),
        backend=select_attention("auto", loaded.dtype, platform),
    )
    outputs = run_to_completion(
        runner, prompts, [params] * len(prompts), chunk_size=chunk_size, eos_token_ids=loaded.eos_token_ids
    )
    mx.clear_cache()
    return [
        Generation(p, out, str(loaded.tokenizer.decode(out, skip_special_tokens=params.skip_special_tokens)))
        for p, out in zip(prompts, outputs, strict=True)
    ]
