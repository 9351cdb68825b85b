"""`--cpu-int8-activations` on the real server and the default model: the flag reaches the CPU path's
projections (decode logprobs move by int8's error, not by zero and not by much) and the answers stay the
model's (the first greedy tokens agree with the exact path)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.e2e.server import RunningServer, running_server

pytestmark = pytest.mark.slow
ASK = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12, "temperature": 0}


def _answer(server: RunningServer) -> tuple[list[str], np.ndarray]:
    body = {**ASK, "model": server.model, "logprobs": True}
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
