"""`metalserve generate`: run prompts or chat messages through the engine core, without a server.

It adds the requests to an EngineCore and steps it until all are done, so it stops exactly where the
server does (EOS, stop ids after min_tokens, max_tokens, the context limit): one stop rule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx

from metalserve.config import EngineConfig
from metalserve.executor.models.families import kv_cache_spec
from metalserve.kvcache.plan import bytes_for_requests
from metalserve.loader import LoadedModel
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from metalserve.serving.context_len import resolve_max_model_len


@dataclass
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None = None


def encode_chat(loaded: LoadedModel, user_message: str) -> list[int]:
    messages = [{"role": "user", "content": user_message}]
    text = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template already wrote the special tokens (BOS, role markers): encode it as is.
    return list(loaded.tokenizer.encode(text, add_special_tokens=False))


def generate_config(loaded: LoadedModel, num_prompts: int, config: EngineConfig | None = None) -> EngineConfig:
    """An engine config for a batch of prompts: room for each at the full context (the pool grows as
    used, so this costs nothing up front) and no warm-up step to size the pool from memory."""
    config = config or EngineConfig()
    if config.kv_cache_memory is not None:
        return replace(config, max_num_seqs=max(num_prompts, 1))
    max_model_len = resolve_max_model_len(config, loaded.max_model_len, loaded.rope_scaled_len)
    spec = kv_cache_spec(loaded, config.block_size, config.kv_cache_dtype)
    kv_bytes = bytes_for_requests(spec, num_prompts, max_model_len)
    return replace(config, kv_cache_memory=kv_bytes, max_num_seqs=max(num_prompts, 1))


def generate(
    loaded: LoadedModel, prompts: list[list[int]], params: SamplingParams, config: EngineConfig | None = None
) -> list[Generation]:
    """Run all prompts together through an EngineCore until each stops."""
    config = generate_config(loaded, len(prompts), config)
    core = build_engine_core(config, loaded)
    for i, prompt in enumerate(prompts):
        if len(prompt) > core.max_model_len:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens, longer than the context ({core.max_model_len})")
        core.add_request(Request(f"gen-{i}", list(prompt), params, eos_token_ids=loaded.eos_token_ids))
    tokens: list[list[int]] = [[] for _ in prompts]
    reasons: list[str | None] = [None] * len(prompts)
    while core.has_unfinished_requests():
        for out in core.step():
            i = int(out.request_id.removeprefix("gen-"))
            tokens[i] += out.new_token_ids
            reasons[i] = out.finish_reason or reasons[i]
    mx.clear_cache()
    return [
        Generation(p, out, _decode(loaded, out, params), why)
        for p, out, why in zip(prompts, tokens, reasons, strict=True)
    ]


def _decode(loaded: LoadedModel, token_ids: list[int], params: SamplingParams) -> str:
    return str(loaded.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens))
