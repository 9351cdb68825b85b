"""A tiny random llama written as GGUF (llama.cpp layout) must give the logits of the HF-layout model."""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.nn as nn
import numpy as np
import pytest

from metalserve.executor.models.families import kv_shape
from metalserve.loader import ModelLoadError, load_model
from tests.loader.tiny_models import logits, reference_llama, write_gguf

T = gguf.GGMLQuantizationType
TOKENS = [1, 40, 41, 260, 261, 7, 99, 2, 150, 33]


# The reference decodes each type with gguf's own numpy dequantizer, independent of MLX's reader.
@pytest.mark.parametrize("kind", [T.F32, T.F16, T.Q8_0, T.Q4_0, T.Q4_1])
def test_dequantized_logits_match_hf_layout(tmp_path: Path, kind: T) -> None:
    path = tmp_path / f"tiny-{kind.name}.gguf"
    reference = reference_llama(write_gguf(path, kind))
    loaded = load_model(str(path), weights="dequantize")
    assert loaded.model_type == "llama" and loaded.weights_desc.startswith("fp32")
    np.testing.assert_allclose(logits(loaded.model, TOKENS), logits(reference, TOKENS), atol=2e-4, rtol=1e-4)


def test_untied_output_tensor_is_used(tmp_path: Path) -> None:
    path = tmp_path / "untied.gguf"
    reference = reference_llama(write_gguf(path, T.F32, tie=False), tie=False)
    loaded = load_model(str(path), weights="dequantize")
    assert loaded.config["tie_word_embeddings"] is False
    np.testing.assert_allclose(logits(loaded.model, TOKENS), logits(reference, TOKENS), atol=2e-4, rtol=1e-4)


def test_quantized_mode_keeps_packed_layers(tmp_path: Path) -> None:
    path = tmp_path / "q8.gguf"
    reference = reference_llama(write_gguf(path, T.Q8_0))
    loaded = load_model(str(path), weights="quantized")
    attn = loaded.model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and attn.q_proj.bits == 8
    assert loaded.weights_desc.startswith("quantized Q8_0")
    np.testing.assert_allclose(logits(loaded.model, TOKENS), logits(reference, TOKENS), atol=2e-4, rtol=1e-4)


def test_metadata_becomes_config_tokenizer_and_eos(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, T.F32)
    loaded = load_model(str(path))
    assert kv_shape(loaded)[:3] == (2, 2, 16)
    assert loaded.max_model_len == 256
    assert loaded.chat_template is not None and "<|im_start|>" in loaded.chat_template
    # The file's EOS (id 0) plus the end-of-turn token its chat template writes (id 2).
    assert loaded.eos_token_ids == frozenset({0, 2})
    tok = loaded.tokenizer
    ids = tok.encode("<|im_start|>user the cat<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2 and 261 in ids  # specials whole, merges applied ("Ġthe")
    assert tok.decode(ids) == "<|im_start|>user the cat<|im_end|>"


def _rewrite_arch(src: Path, dst: Path) -> None:
    """Same file, architecture string changed in place (same length keeps every offset valid)."""
    data = src.read_bytes()
    dst.write_bytes(data.replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00gemma", 1))


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    write_gguf(tmp_path / "a.gguf", T.F32)
    _rewrite_arch(tmp_path / "a.gguf", tmp_path / "b.gguf")
    with pytest.raises(ModelLoadError, match="architecture 'gemma' is not supported"):
        load_model(str(tmp_path / "b.gguf"))


def test_unsupported_tensor_type_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "iq4.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    block, size = gguf.GGML_QUANT_SIZES[T.IQ4_NL]
    writer.add_tensor("token_embd.weight", np.zeros((4, 64 // block * size), np.uint8), raw_dtype=T.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"type IQ4_NL, which is not supported.*Q4_K, Q5_K, Q6_K"):
        load_model(str(path))


def test_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    write_gguf(tmp_path / "a.gguf", T.F32)
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "a.gguf").read_bytes()[:2000])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file.*truncated"):
        load_model(str(tmp_path / "cut.gguf"))


def test_not_a_gguf_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(ModelLoadError, match="GGUF magic"):
        load_model(str(path))
