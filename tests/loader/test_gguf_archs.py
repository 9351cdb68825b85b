"""Each GGUF architecture loads into mlx-lm's own class with the logits of the directly built model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from metalserve.executor.models.families import kv_shape
from metalserve.loader import load_model
from tests.loader.gguf_arch_models import reference_model, write_arch_gguf
from tests.loader.gguf_blocks import T
from tests.loader.tiny_models import logits

TOKENS = [1, 40, 41, 260, 261, 7, 99, 2, 150, 33, 12, 13, 14, 200, 201, 5]  # longer than gemma's window of 8

# Each architecture through metalserve's reader and (Q8_0/F16) through mx.load; "llama3" is a llama GGUF
# with llama-3 rope factors. Random Q4_K/Q5_K blocks have a large common offset that flattens attention,
# so the row-order checks use the other types.
CASES = [
    ("llama", T.Q6_K),
    ("llama", T.BF16),
    ("llama3", T.Q8_0),
    ("qwen2", T.Q5_0),
    ("qwen3", T.Q3_K),
    ("qwen3moe", T.Q4_K),
    ("qwen3moe", T.Q8_0),
    ("gemma3", T.Q6_K),
    ("gemma3", T.Q8_0),
    ("phi3", T.Q2_K),
    ("phi3", T.F16),
]
MODEL_TYPES = {
    "llama": "llama",
    "llama3": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
}


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize(("arch", "kind"), CASES, ids=[f"{a}-{k.name}" for a, k in CASES])
def test_architecture_logits_equal_mlx_lm_on_the_decoded_weights(tmp_path: Path, arch: str, kind: T) -> None:
    path = tmp_path / f"{arch}-{kind.name}.gguf"
    reference = reference_model(arch, write_arch_gguf(path, arch, kind))
    loaded = load_model(str(path), weights="dequantize")
    assert loaded.model_type == MODEL_TYPES[arch]
    assert type(loaded.model) is type(reference)
    assert kv_shape(loaded).head_dim == 64 and kv_shape(loaded).num_kv_heads == 2
    tokens = TOKENS * 12 if arch == "llama3" else TOKENS  # the scaled low frequencies show at long range
    close(logits(loaded.model, tokens), logits(reference, tokens))
    # Nothing stays packed when dequantizing, MoE experts included.
    assert not any("Quantized" in type(m).__name__ for _, m in loaded.model.named_modules())
