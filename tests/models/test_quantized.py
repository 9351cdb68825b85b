"""Quantized MLX directories (config.json + safetensors, as mlx_lm saves them) serve mlx-lm's tokens.

4-bit affine everywhere (fused quantized q/k/v, quantized experts and embedding), 8-bit affine on a
windowed model, and mxfp4 experts as gpt-oss ships them. `quantized` keeps the packed weights as on
Apple silicon; `auto` on this CPU applies the dequantize rule (loader/weights_mode.py) to linears and embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import load as mlx_lm_load

from metalserve.config import EngineConfig
from metalserve.loader import load_model
from metalserve.serving.build import build_engine_core
from tests.loader.tiny_tokenizer import save_hf_tokenizer, vocab_tokens
from tests.models import golden
from tests.models.archs import build, config_of

CASES = {
    "affine4": ("qwen3_moe", {"group_size": 32, "bits": 4}, None),
    "mxfp4": ("gpt_oss", {"group_size": 32, "bits": 4, "mode": "mxfp4"}, SwitchLinear),
    "affine8": ("gemma3_text", {"group_size": 32, "bits": 8}, None),  # no experts: all linears packed
}


def write_quantized(directory: Path, case: str) -> Path:
    arch, quant, only = CASES[case]
    vocab = len(vocab_tokens())
    model = build(arch, vocab_size=vocab)
    predicate = (lambda _path, m: isinstance(m, only)) if only is not None else None
    nn.quantize(model, **quant, class_predicate=predicate)  # type: ignore[arg-type]
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({**config_of(arch, vocab_size=vocab), "quantization": quant}))
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    save_hf_tokenizer(directory)
    return directory


MATRIX = [
    pytest.param(case, weights, marks=[pytest.mark.slow] if weights == "auto" and case != "affine4" else [])
    for case in CASES
    for weights in ("quantized", "auto")
]


@pytest.mark.parametrize(("case", "weights"), MATRIX)
def test_a_quantized_directory_serves_mlx_lm_tokens(tmp_path: Path, case: str, weights: str) -> None:
    path = write_quantized(tmp_path / case, case)
    reference_model = mlx_lm_load(str(path))[0]
    (prompt,) = golden.prompts([40], len(vocab_tokens()), seed=3)
    want = golden.reference(reference_model, prompt)
    loaded = load_model(str(path), weights=weights)
    quantized = [type(m).__name__ for _, m in loaded.model.named_modules() if "Quantized" in type(m).__name__]
    # The CPU's dequantize rule (auto) unpacks experts too; `--weights quantized` keeps them packed.
    assert ("QuantizedSwitchLinear" in quantized) == (case != "affine8" and weights == "quantized")
    assert ("QuantizedLinear" in quantized) == (weights == "quantized" and case != "mxfp4")
    config = EngineConfig(kv_cache_memory=1 << 24, block_size=16, max_num_batched_tokens=16)  # chunked
    (got,) = golden.serve(build_engine_core(config, loaded), [prompt])
    golden.check(got, want)
