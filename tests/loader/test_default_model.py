"""The embedded default model (SmolLM2-135M-Instruct Q4_1), checked against transformers' GGUF loader.

tests/data/smollm2_reference.json was recorded once by tools/record_gguf_reference.py (torch fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from metalserve.executor.models.families import kv_shape
from metalserve.loader import LoadedModel, load_model
from metalserve.platform import current_platform

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "smollm2_reference.json"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_model() -> LoadedModel:
    return load_model(None, weights="dequantize")


def _greedy(loaded: LoadedModel, prompt: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    """Last-prompt-token logits and n greedy tokens, with mlx-lm's own KV cache (EOS does not stop it)."""
    cache = make_prompt_cache(loaded.model)
    logits = loaded.model(mx.array([prompt]), cache=cache)[0, -1]
    first = np.array(logits)
    tokens: list[int] = []
    for _ in range(n):
        token = int(mx.argmax(logits).item())
        tokens.append(token)
        logits = loaded.model(mx.array([[token]]), cache=cache)[0, -1]
    return first, tokens


def test_loads_with_chat_template_and_eos(default_model: LoadedModel) -> None:
    m = default_model
    assert m.source.startswith("embedded default: ") and m.model_type == "llama"
    assert kv_shape(m)[:3] == (30, 3, 64) and m.max_model_len == 8192
    assert m.weights_desc.startswith("fp32 (dequantized from Q4_1") and kv_shape(m).dtype == mx.float32
    assert m.eos_token_ids == frozenset({2})
    tok = m.tokenizer
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and ids.count(1) == text.count("<|im_start|>")


def test_matches_transformers_reference(default_model: LoadedModel) -> None:
    reference = json.loads(REFERENCE.read_text())
    for case in reference["prompts"]:
        tok = default_model.tokenizer
        if case["chat"]:
            messages = [{"role": "user", "content": case["text"]}]
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(case["text"])
        assert ids == case["prompt_ids"], case["text"]
        logits, tokens = _greedy(default_model, ids, len(case["greedy_tokens"]))
        top_ids = [i for i, _ in case["top_logits"]]
        top_values = np.array([v for _, v in case["top_logits"]])
        assert [int(i) for i in np.argsort(-logits)[: len(top_ids)]] == top_ids, case["text"]
        np.testing.assert_allclose(logits[top_ids], top_values, atol=1e-3)  # measured: 3e-5
        assert tokens == case["greedy_tokens"], case["text"]


def test_quantized_weights_match_the_reference_too() -> None:
    """The path Metal (and big models) take: packed Q4_1 weights, fp32 activations on the CPU."""
    loaded = load_model(None, weights="quantized")
    assert loaded.weights_desc == "quantized Q4_1"
    case = json.loads(REFERENCE.read_text())["prompts"][0]
    logits = np.array(loaded.model(mx.array([case["prompt_ids"]]))[0, -1])
    top_ids = [i for i, _ in case["top_logits"]]
    np.testing.assert_allclose(logits[top_ids], [v for _, v in case["top_logits"]], atol=1e-3)


@pytest.mark.skipif(not current_platform().host_compute, reason="the codes path is MLX's CPU backend's")
def test_the_codes_path_matches_the_reference_and_the_fp32_path(default_model: LoadedModel) -> None:
    """The CPU default keeps the Q4_1 GGUF in its packed codes (no fp32 copy): the same greedy tokens as
    transformers' reference, and log-probabilities within 1e-3 of the fp32 dequantized model's."""
    codes = load_model(None)
    assert "kept in its codes" in codes.weights_desc
    for case in json.loads(REFERENCE.read_text())["prompts"]:
        ids = case["prompt_ids"]
        logits, tokens = _greedy(codes, ids, len(case["greedy_tokens"]))
        assert tokens == case["greedy_tokens"], case["text"]
        want = np.array(default_model.model(mx.array([ids]))[0, -1])
        delta = np.abs((logits - np.logaddexp.reduce(logits)) - (want - np.logaddexp.reduce(want)))
        assert delta.max() < 1e-3, case["text"]
