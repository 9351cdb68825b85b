"""Requests under several LoRA adapters and the base model, all in one packed batch, give what mlx-lm
gives with each adapter fused into the weights (tokens equal, logprobs within float tolerance)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from metalserve.config import ConfigError, EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.lora.files import AdapterError
from metalserve.lora.request import LoraRequest
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from tests.executor.test_runner_golden import prompts_of
from tests.lora.tiny_adapters import ALL_KEYS, as_peft, fused_model, loaded_of, make_mlx_lm_adapter

NUM_TOKENS = 8
MOE_BLOCKS = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}  # where each MoE family keeps its experts
LOGPROB_TOLERANCE = 1e-3


def reference(model: nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """mlx-lm's own model call with its contiguous cache: greedy tokens and each one's logprob."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)
    tokens, logprobs = [], []
    for _ in range(n):
        row = logits[0, -1].astype(mx.float32)
        token = int(mx.argmax(row).item())
        tokens.append(token)
        logprobs.append(float((row - mx.logsumexp(row))[token].item()))
        logits = model(mx.array([[token]]), cache=cache)
    return tokens, logprobs


def run(
    core: EngineCore, jobs: dict[str, tuple[list[int], LoraRequest | None]]
) -> dict[str, tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    for rid, (prompt, lora) in jobs.items():
        core.add_request(Request(rid, prompt, params, lora=lora))
    got: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in jobs}
    while core.has_unfinished_requests():
        for out in core.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(lp.logprob for lp in out.new_logprobs or [])
    return got


def adapters(tmp_path: Path, model_type: str) -> dict[str, Path]:
    """Three adapters: attention-only (mlx-lm), attention + MLP down projection (mlx-lm), and the first
    one's weights saved as PEFT saves them, with another scale."""
    keys = ALL_KEYS
    if model_type in MOE_BLOCKS:  # the router and every expert's gate, up and down (mlx-lm's LoRASwitchLinear)
        block = MOE_BLOCKS[model_type]
        keys = [
            *ALL_KEYS[:4],
            f"{block}.gate",
            *(f"{block}.switch_mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
        ]
    first = make_mlx_lm_adapter(tmp_path / "a", model_type, seed=1, rank=4, scale=2.0)
    second = make_mlx_lm_adapter(tmp_path / "b", model_type, seed=2, rank=8, scale=1.0, keys=keys)
    return {"a": first, "b": second, "c": as_peft(first, tmp_path / "c", alpha=4 * 3.0)}


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_a_batch_mixing_three_adapters_and_the_base_equals_the_fused_models(tmp_path: Path, model_type: str) -> None:
    paths = adapters(tmp_path, model_type)
    prompts = prompts_of([13, 21, 9, 30], 256, seed=7)
    loaded = loaded_of(model_type)
    fused = {name: fused_model(path, model_type) for name, path in paths.items() if name != "c"}
    # PEFT's c is a's weights at scale alpha / r = 3.0: fuse a copy of a saved at that scale.
    fused["c"] = fused_model(make_mlx_lm_adapter(tmp_path / "a3", model_type, seed=1, rank=4, scale=3.0), model_type)
    expected = {f"base{i}": reference(loaded.model, p, NUM_TOKENS) for i, p in enumerate(prompts[:2])}
    for i, prompt in enumerate(prompts):
        for name, model in fused.items():
            expected[f"{name}{i}"] = reference(model, prompt, NUM_TOKENS)
    modules = tuple((name, str(path)) for name, path in paths.items())
    config = EngineConfig(
        kv_cache_memory=1 << 23, max_num_batched_tokens=512, block_size=8, enable_lora=True, lora_modules=modules
    )
    core = build_engine_core(config, loaded)
    loras = core.lora_requests()
    jobs: dict[str, tuple[list[int], LoraRequest | None]] = {f"base{i}": (p, None) for i, p in enumerate(prompts[:2])}
    for i, prompt in enumerate(prompts):
        jobs |= {f"{name}{i}": (prompt, loras[name]) for name in fused}
    got = run(core, jobs)
    for rid, (tokens, logprobs) in expected.items():
        assert got[rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(got[rid][1], logprobs, strict=True)) < LOGPROB_TOLERANCE, rid
    worst = max(abs(a - b) for rid, (_, lps) in expected.items() for a, b in zip(got[rid][1], lps, strict=True))
    print(f"{model_type}: {len(expected)} requests, tokens equal, max |logprob delta| {worst:.1e}")  # the note's figure
    # The adapters do change the output (else the test would prove nothing).
    assert expected["a0"][0] != expected["b0"][0] != expected["c0"][0]


def test_an_adapter_of_rank_above_the_limit_is_refused_at_start_up(tmp_path: Path) -> None:
    path = make_mlx_lm_adapter(tmp_path / "a", rank=8)
    config = EngineConfig(kv_cache_memory=1 << 22, enable_lora=True, max_lora_rank=4, lora_modules=(("a", str(path)),))
    with pytest.raises(ConfigError, match="'a' has rank 8, above --max-lora-rank 4"):
        build_engine_core(config, loaded_of("llama"))


def test_an_adapter_of_another_model_shape_is_refused(tmp_path: Path) -> None:
    path = make_mlx_lm_adapter(tmp_path / "a", hidden_size=32)  # trained on a narrower llama
    config = EngineConfig(kv_cache_memory=1 << 22, enable_lora=True, lora_modules=(("a", str(path)),))
    with pytest.raises(ConfigError, match=r"model.layers.0.self_attn.q_proj maps 32 -> 32, the model's layer 64 -> 64"):
        build_engine_core(config, loaded_of("llama"))


def test_a_missing_adapter_directory_is_a_start_up_error(tmp_path: Path) -> None:
    config = EngineConfig(kv_cache_memory=1 << 22, enable_lora=True, lora_modules=(("a", str(tmp_path / "none")),))
    with pytest.raises(ConfigError, match="--lora-modules: LoRA adapter 'a': .* is not a directory"):
        build_engine_core(config, loaded_of("llama"))


def test_a_request_under_an_adapter_not_loaded_is_refused(tmp_path: Path) -> None:
    core = build_engine_core(EngineConfig(kv_cache_memory=1 << 22, enable_lora=True), loaded_of("llama"))
    with pytest.raises(ValueError, match="LoRA adapter 'x' is not loaded"):
        core.add_request(Request("r", [1, 2], SamplingParams(), lora=LoraRequest("x", "x@0")))


def test_the_adapter_slots_are_held_from_start_up_and_counted_with_the_weights(tmp_path: Path) -> None:
    plain = build_engine_core(EngineConfig(kv_cache_memory=1 << 22), loaded_of("llama"))
    config = EngineConfig(kv_cache_memory=1 << 22, enable_lora=True, max_loras=3, max_lora_rank=8)
    core = build_engine_core(config, loaded_of("llama"))
    # llama's 7 linears per layer, 2 layers: q, o (64 -> 64), k, v (64 -> 32), gate, up (64 -> 128), down.
    dims = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)] * 2
    slots = 3 * sum((d_in + d_out) * 8 * 4 for d_in, d_out in dims)
    assert core.runner.lora is not None and core.runner.lora.nbytes == slots
    assert core.weight_bytes == plain.weight_bytes + slots


def test_an_adapter_in_use_is_not_unloaded_and_a_reload_under_its_name_is_a_new_key(tmp_path: Path) -> None:
    first, second = make_mlx_lm_adapter(tmp_path / "a", seed=1), make_mlx_lm_adapter(tmp_path / "b", seed=2)
    core = build_engine_core(EngineConfig(kv_cache_memory=1 << 22, enable_lora=True, max_loras=1), loaded_of("llama"))
    old = core.load_lora("x", str(first))
    core.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=2), lora=old))
    with pytest.raises(AdapterError, match="'x' has 1 requests in flight"):
        core.unload_lora("x")
    while core.has_unfinished_requests():
        core.step()
    core.unload_lora("x")
    new = core.load_lora("x", str(second))  # the one slot is free again
    assert new.name == old.name and new.key != old.key  # its blocks never hit the old adapter's
    with pytest.raises(AdapterError, match="'x' is already loaded"):
        core.load_lora("x", str(first))


def test_a_gguf_kept_in_its_codes_takes_adapters_as_its_fp32_twin_does(tmp_path: Path) -> None:
    """On the CPU path a fast-path GGUF's projections are CodesLinear (packed codes, no fp32 copy): an
    adapter wraps them like any linear, and answers as on the same file dequantized to fp32."""
    from metalserve.loader import load_model
    from metalserve.loader.codes_linear import CodesLinear
    from metalserve.platform import current_platform
    from tests.loader.gguf_arch_models import FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, write_arch_gguf
    from tests.loader.gguf_blocks import T

    path = tmp_path / "llama.gguf"
    write_arch_gguf(path, "llama", T.Q8_0)
    shape = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "intermediate_size": FFN}
    shape |= {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM}
    adapter = make_mlx_lm_adapter(tmp_path / "a", "llama", seed=3, rank=4, scale=2.0, **shape)
    config = EngineConfig(kv_cache_memory=1 << 23, block_size=8, enable_lora=True, lora_modules=(("a", str(adapter)),))
    prompts = prompts_of([11, 17], 200, seed=4)
    answers = []
    for weights in ("auto", "dequantize"):
        loaded = load_model(str(path), weights=weights)
        kept = any(isinstance(m, CodesLinear) for _, m in loaded.model.named_modules())
        assert kept == (weights == "auto" and current_platform().host_compute)
        core = build_engine_core(config, loaded)
        lora = core.lora_requests()["a"]
        jobs = {f"{tag}{i}": (p, lora if tag == "a" else None) for i, p in enumerate(prompts) for tag in ("a", "base")}
        answers.append(run(core, jobs))
    codes, fp32 = answers
    for rid, (tokens, logprobs) in fp32.items():
        assert codes[rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(codes[rid][1], logprobs, strict=True)) < LOGPROB_TOLERANCE, rid
    assert fp32["a0"][0] != fp32["base0"][0]  # the adapter changes the answer


def test_a_request_scale_multiplies_the_adapter_delta_in_a_mixed_batch(tmp_path: Path) -> None:
    """lora_scale s over an adapter of scale 2 answers as mlx-lm's model fused at scale 2 s; scale 0 as the
    base model; requests at several scales of one adapter share a step."""
    path = make_mlx_lm_adapter(tmp_path / "a", seed=1, rank=4, scale=2.0, keys=ALL_KEYS)
    loaded = loaded_of("llama")
    prompts = prompts_of([13, 21], 256, seed=8)
    fused = {
        s: fused_model(make_mlx_lm_adapter(tmp_path / f"a{s}", seed=1, rank=4, scale=2.0 * s, keys=ALL_KEYS))
        for s in (0.5, 1.5)
    }
    expected = {f"0/{i}": reference(loaded.model, prompt, NUM_TOKENS) for i, prompt in enumerate(prompts)}
    config = EngineConfig(kv_cache_memory=1 << 23, block_size=8, enable_lora=True, lora_modules=(("a", str(path)),))
    core = build_engine_core(config, loaded)
    lora = core.lora_requests()["a"]
    jobs: dict[str, tuple[list[int], LoraRequest | None]] = {}
    for i, prompt in enumerate(prompts):
        for s, model in fused.items():
            jobs[f"{s}/{i}"] = (prompt, replace(lora, scale=s))
            expected[f"{s}/{i}"] = reference(model, prompt, NUM_TOKENS)
        jobs[f"0/{i}"] = (prompt, replace(lora, scale=0.0))
    got = run(core, jobs)
    for rid, (tokens, logprobs) in expected.items():
        assert got[rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(got[rid][1], logprobs, strict=True)) < LOGPROB_TOLERANCE, rid
    assert expected["0.5/0"][0] != expected["1.5/0"][0] != expected["0/0"][0]
