"""An MLA checkpoint on disk, in Hugging Face's layout (kv_b_proj, one tensor per expert), loads through
the loader with latent KV facts, and serves mlx-lm's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from metalserve.executor.models.families import kv_shape
from metalserve.loader import load_model
from tests.loader.tiny_tokenizer import save_hf_tokenizer, vocab_tokens
from tests.models.mla_golden import (
    TINY_MLA,
    assert_matches,
    engine_greedy,
    make_core,
    mlx_lm_greedy,
    prompts_of,
    tiny_mla,
)


def hf_layout(model: nn.Module) -> dict[str, mx.array]:
    """mlx-lm's parameters as DeepSeek's checkpoints store them: the kv_b projection whole, experts apart."""
    out: dict[str, mx.array] = {}
    for name, w in tree_flatten(model.parameters()):
        if ".embed_q." in name or ".unembed_out." in name:
            continue
        if ".switch_mlp." in name:
            prefix, proj = name.split(".switch_mlp.")
            out |= {f"{prefix}.experts.{e}.{proj}": w[e] for e in range(w.shape[0])}
            continue
        out[name] = w
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if "kv_b_proj" in attn:  # deepseek_v2's module keeps it so already
            continue
        k_rows = attn.embed_q.weight.swapaxes(-1, -2)  # [H, nope, rank]
        out[f"model.layers.{i}.self_attn.kv_b_proj.weight"] = mx.concatenate(
            [k_rows, attn.unembed_out.weight], axis=1
        ).reshape(-1, attn.kv_lora_rank)
    return out


# Every projection's input a multiple of the quantization group (32).
GROUPED = dict(q_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32, moe_intermediate_size=64)


def write_dir(directory: Path, model_type: str, quantize_bits: int | None = None) -> nn.Module:
    overrides = {"vocab_size": len(vocab_tokens()), **(GROUPED if quantize_bits else {})}
    model = tiny_mla(model_type, **overrides)
    config = {**TINY_MLA, "model_type": model_type, **overrides, "eos_token_id": 2}
    weights = hf_layout(model)
    if quantize_bits is not None:
        nn.quantize(model, group_size=32, bits=quantize_bits)
        config["quantization"] = {"group_size": 32, "bits": quantize_bits}
        weights = dict(tree_flatten(model.parameters()))
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    (directory / "config.json").write_text(json.dumps(config))
    save_hf_tokenizer(directory)
    return model


@pytest.mark.parametrize(("model_type", "bits"), [("deepseek_v3", None), ("deepseek_v3", 4), ("deepseek_v2", None)])
def test_an_mla_directory_loads_with_latent_kv_and_serves_its_tokens(
    tmp_path: Path, model_type: str, bits: int | None
) -> None:
    model = write_dir(tmp_path, model_type, bits)
    loaded = load_model(str(tmp_path))
    assert loaded.model_type == model_type and kv_shape(loaded)[1:4] == (1, 40, 32)
    (prompt,) = prompts_of([17], loaded.model.args.vocab_size, seed=4)
    want = mlx_lm_greedy(model, prompt, 12)
    core = make_core(loaded.model, model_type)
    (got,) = engine_greedy(core, [prompt], 12)
    assert_matches(got, want)
