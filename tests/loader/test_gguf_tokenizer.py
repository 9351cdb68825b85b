"""Tokenizers rebuilt from GGUF metadata: sentencepiece-style ("llama", as llama-2/mistral files carry)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from metalserve.loader import ModelLoadError
from metalserve.loader.gguf_tokenizer import tokenizer_from_gguf

_PIECES = ["▁", "t", "h", "e", "▁t", "he", "▁the", "c", "a", "▁c", "at", "▁cat"]


def _spm_metadata() -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + _PIECES
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": mx.array([0.0] * 259 + [-float(i) for i in range(len(_PIECES))]),
        "tokenizer.ggml.token_type": mx.array([2, 3, 3] + [6] * 256 + [1] * len(_PIECES)),
        "tokenizer.ggml.bos_token_id": mx.array(1),
        "tokenizer.ggml.eos_token_id": mx.array(2),
        "tokenizer.ggml.unknown_token_id": mx.array(0),
    }


def test_sentencepiece_vocabulary_adds_bos_and_round_trips() -> None:
    tok = tokenizer_from_gguf(_spm_metadata(), "llama")
    ids = tok.encode("the cat")
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "▁the", "▁cat"]
    assert tok.decode(ids, skip_special_tokens=True) == "the cat"
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")


def test_add_bos_flag_from_the_file_is_honoured() -> None:
    metadata = {**_spm_metadata(), "tokenizer.ggml.add_bos_token": mx.array(False)}
    tok = tokenizer_from_gguf(metadata, "llama")
    assert tok.encode("the cat") == [265, 270]


def test_unknown_tokenizer_model_is_a_clear_error() -> None:
    metadata = {**_spm_metadata(), "tokenizer.ggml.model": "rwkv"}
    with pytest.raises(ModelLoadError, match="Cannot build the tokenizer.*'rwkv'"):
        tokenizer_from_gguf(metadata, "llama")


def test_file_without_vocabulary_is_a_clear_error() -> None:
    with pytest.raises(ModelLoadError, match="carries no tokenizer"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "gpt2"}, "llama")
