"""Async scheduling (step k+1 scheduled while step k computes) gives the tokens of in-order stepping.

32 concurrent requests under a 64-token budget (chunked prefill) and a KV pool too small for all of
them (preemption), with penalties, seeded sampling, logprobs and stop token ids that end requests at
steps the lookahead could not know: tokens, log-probabilities and finish reasons must be identical.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.scheduler import Scheduler
from metalserve.serving.build import build_engine_core
from tests.models import golden
from tests.models.archs import VOCAB, build

NUM_REQUESTS = 32
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # layers x (K, V) x KV heads x head dim x float32 x block size


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None


def _params(i: int) -> SamplingParams:
    n = 10 + i % 7
    kind = i % 4
    if kind == 0:  # penalties over the request's own history (the token from the step before counts)
        return SamplingParams(
            temperature=0,
            max_tokens=n,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            ignore_eos=True,
        )
    if kind == 1:  # seeded sampling: one draw per (seed, output index)
        return SamplingParams(temperature=0.9, top_p=0.9, seed=1000 + i, max_tokens=n, ignore_eos=True)
    if kind == 2:
        return SamplingParams(temperature=0, max_tokens=n, logprobs=2, ignore_eos=True)
    # A stop on a common id: the request ends at a step the lookahead scheduled past.
    return SamplingParams(temperature=0, max_tokens=n, stop_token_ids=list(range(0, VOCAB, 5)), ignore_eos=True)


def _run(async_scheduling: bool) -> tuple[dict[str, Result], EngineCore]:
    config = EngineConfig(
        kv_cache_memory=40 * BLOCK_BYTES,
        max_model_len=128,
        block_size=16,
        max_num_batched_tokens=64,
        max_num_seqs=NUM_REQUESTS,
        async_scheduling=async_scheduling,
    )
    core = build_engine_core(config, golden.loaded_of(build("llama"), "llama", max_model_len=128))
    assert core.async_scheduling is async_scheduling
    rng = np.random.default_rng(7)
    results: dict[str, Result] = {}
    for i in range(NUM_REQUESTS):
        prompt = rng.integers(0, VOCAB, size=int(rng.integers(8, 90))).tolist()
        core.add_request(Request(f"r{i}", prompt, _params(i)))
        results[f"r{i}"] = Result()
    while core.has_unfinished_requests():
        for out in core.step():
            r = results[out.request_id]
            r.tokens += out.new_token_ids
            r.logprobs += [lp.logprob for lp in out.new_logprobs or []]
            r.finish = out.finish_reason or r.finish
    return results, core


def test_tokens_are_identical_with_async_scheduling_on_and_off(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept: list[str] = []  # tokens sampled for requests that a lookahead schedule() preempted meanwhile
    keep = Scheduler._append_preempted

    def spy(self: Scheduler, request: Request, *args: Any) -> Any:
        kept.append(request.request_id)
        return keep(self, request, *args)

    monkeypatch.setattr(Scheduler, "_append_preempted", spy)
    with caplog.at_level(logging.INFO, logger="metalserve.engine"):
        on, core_on = _run(True)
    assert "async scheduling: on" in caplog.text
    off, core_off = _run(False)
    assert core_on.scheduler.num_placeholders > 100 and core_off.scheduler.num_placeholders == 0
    assert core_on.scheduler.num_preemptions > 0 and core_off.scheduler.num_preemptions > 0
    assert kept  # the lookahead preempted a request whose token was on its way, and kept the token
    assert {rid: r.finish for rid, r in on.items()} == {rid: r.finish for rid, r in off.items()}
    assert sum(r.finish == "stop" for r in off.values()) >= 3  # stop ids ended requests early
    for rid in off:
        assert on[rid].tokens == off[rid].tokens, rid
        np.testing.assert_allclose(on[rid].logprobs, off[rid].logprobs, atol=1e-4)
    assert sum(len(r.logprobs) for r in off.values()) > 0


def test_speculative_decoding_turns_it_off_with_a_start_up_line(caplog: pytest.LogCaptureFixture) -> None:
    from metalserve.speculative_config import SpeculativeConfig

    spec = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2}')
    config = EngineConfig(kv_cache_memory=1 << 22, max_model_len=128, speculative_config=spec, async_scheduling=True)
    with caplog.at_level(logging.INFO, logger="metalserve.engine"):
        core = build_engine_core(config, golden.loaded_of(build("llama"), "llama", max_model_len=128))
    assert not core.async_scheduling and not core.scheduler.lookahead
    assert "async scheduling: off, speculative decoding" in caplog.text
    (prompt,) = golden.prompts([golden.SHORT], VOCAB)
    (got,) = golden.serve(core, [prompt])
    assert got.tokens == golden.reference(build("llama"), prompt).tokens


def test_by_default_it_is_off_on_the_cpu_backend_with_a_start_up_line(caplog: pytest.LogCaptureFixture) -> None:
    """Measured slower where the forward shares the CPU cores; on with Metal (platform.metal)."""
    config = EngineConfig(kv_cache_memory=1 << 22, max_model_len=128)
    assert config.async_scheduling is None
    with caplog.at_level(logging.INFO, logger="metalserve.engine"):
        core = build_engine_core(config, golden.loaded_of(build("llama"), "llama", max_model_len=128))
    assert not core.async_scheduling and not core.scheduler.lookahead
    assert "async scheduling: off on MLX's CPU backend" in caplog.text
