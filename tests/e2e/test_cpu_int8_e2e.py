"""`--cpu-int8-activations` and `--cpu-bf16-prefill` on the real server and the default model: each flag
reaches the CPU path's projections (decode logprobs, or a long prompt's first token's, move by int8's or
bfloat16's error, not by zero and not by much) and the answers stay the model's (the first greedy tokens
agree with the exact path)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.e2e.server import RunningServer, running_server

pytestmark = pytest.mark.slow
ASK = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12, "temperature": 0}


def _answer(server: RunningServer, ask: dict | None = None) -> tuple[list[str], np.ndarray]:
    body = {**(ask or ASK), "model": server.model, "logprobs": True}
    choice = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=300).json()["choices"][0]
    content = choice["logprobs"]["content"]
    return [c["token"] for c in content], np.array([c["logprob"] for c in content])


def test_int8_activations_move_decode_logprobs_by_int8_error_only() -> None:
    flags = ("--max-model-len", "1024", "--kv-cache-memory", str(64 << 20))
    with running_server(*flags, "--cpu-int8-activations", "off") as exact:
        tokens, logprobs = _answer(exact)
    with running_server(*flags, "--cpu-int8-activations", "on") as fast:
        tokens_int8, logprobs_int8 = _answer(fast)
    assert tokens_int8[:4] == tokens[:4]
    same = min(len(tokens), len(tokens_int8))
    agree = next((i for i in range(same) if tokens[i] != tokens_int8[i]), same)
    delta = np.abs(logprobs[1:agree] - logprobs_int8[1:agree])  # the first token comes from the prefill
    assert delta.max() > 0 and delta.max() < 0.5, delta


def test_bf16_prefill_moves_a_long_prompts_first_logprob_by_bf16_error_only() -> None:
    """A prompt of some 300 tokens, prefilled through the GEMM route: its first token's log-probability
    (the prefill's own) moves, a little."""
    text = " ".join(f"Item {i} is a {c} box." for i, c in enumerate(["red", "green", "blue"] * 12))
    ask = {
        "messages": [{"role": "user", "content": f"{text} Which colour is item 7?"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    flags = ("--max-model-len", "1024", "--kv-cache-memory", str(64 << 20))
    with running_server(*flags, "--cpu-bf16-prefill", "off") as exact:
        tokens, logprobs = _answer(exact, ask)
    with running_server(*flags, "--cpu-bf16-prefill", "on") as fast:
        tokens_bf16, logprobs_bf16 = _answer(fast, ask)
    assert tokens_bf16[:1] == tokens[:1]
    delta = abs(logprobs[0] - logprobs_bf16[0])
    assert 0 < delta < 0.5, (logprobs[0], logprobs_bf16[0])
