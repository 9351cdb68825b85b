"""Seeds: a seeded request's draws depend only on (seed, tokens generated so far)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metalserve.executor.sampler as sampler_module
from metalserve.executor.array_backend import ArrayBackend, pick_backend
from metalserve.executor.sampler import Sampler
from metalserve.executor.seeding import MAX_UNIFORM, UniformSource, seeded_uniform
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams


@pytest.fixture(autouse=True, params=["mlx", "numpy"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ArrayBackend:
    """Run every test on both array backends: Sampler() then uses this one."""
    chosen = pick_backend(request.param)
    monkeypatch.setattr(sampler_module, "pick_backend", lambda name="auto": chosen)
    return chosen


VOCAB = 16
STEPS = 24


def step_logits(step: int, rows: int = 1) -> mx.array:
    """A fixed 'model': the same logits for a given step, whatever the batch."""
    row = np.random.default_rng(step).normal(size=VOCAB).astype(np.float32)
    return mx.array(np.tile(row, (rows, 1)))


def generate(
    sampler: Sampler, seed: int | None, start: list[int] | None = None, companions: int = 0, position: int = 0
) -> list[int]:
    """Run STEPS steps for one request, batched with `companions` unseeded requests at `position`."""
    request = Request("r", [1, 2], SamplingParams(seed=seed), output_token_ids=list(start or []))
    others = [Request(f"o{i}", [3], SamplingParams(temperature=0.7)) for i in range(companions)]
    while len(request.output_token_ids) < STEPS:
        batch = others[:position] + [request] + others[position:]
        out = sampler(step_logits(len(request.output_token_ids), len(batch)), batch)
        request.output_token_ids.append(out.token_ids[position])
    return request.output_token_ids


def test_same_seed_same_text_whatever_the_engine_seed() -> None:
    assert generate(Sampler(0), seed=7) == generate(Sampler(123), seed=7)


def test_different_seeds_give_different_text() -> None:
    assert generate(Sampler(0), seed=7) != generate(Sampler(0), seed=8)


def test_batch_composition_does_not_change_a_seeded_request() -> None:
    alone = generate(Sampler(0), seed=42)
    assert generate(Sampler(5), seed=42, companions=5, position=3) == alone
    assert generate(Sampler(9), seed=42, companions=2, position=0) == alone


def test_preempted_and_recomputed_request_continues_the_same_stream() -> None:
    full = generate(Sampler(0), seed=11)
    assert generate(Sampler(77), seed=11, start=full[:10]) == full


def test_unseeded_requests_follow_the_engine_seed() -> None:
    assert generate(Sampler(3), seed=None) == generate(Sampler(3), seed=None)
    assert generate(Sampler(3), seed=None) != generate(Sampler(4), seed=None)


def test_seeded_draws_follow_the_distribution() -> None:
    probs = np.array([0.6, 0.3, 0.1])
    logits = mx.array(np.log(probs)[None].astype(np.float32))
    tokens = [Sampler()(logits, [Request("r", [0], SamplingParams(seed=s))]).token_ids[0] for s in range(1500)]
    assert np.abs(np.bincount(tokens, minlength=3) / 1500 - probs).max() < 0.04


def test_seeded_uniform_is_uniform_and_bounded() -> None:
    u = np.array([seeded_uniform(s, t) for s in range(100) for t in range(100)])
    assert u.min() >= 0.0 and u.max() < 1.0
    assert np.abs(np.histogram(u, bins=10, range=(0, 1))[0] / len(u) - 0.1).max() < 0.01
    assert seeded_uniform(-5, 0) != seeded_uniform(5, 0)


def test_uniform_source_checks_its_input_and_caps_below_one() -> None:
    source = UniformSource(0)
    with pytest.raises(ValueError, match="2 seeds but 1 steps"):
        source.draw([1, 2], [0])
    with pytest.raises(ValueError, match="step must be >= 0"):
        seeded_uniform(1, -1)
    draws = source.draw([None] * 1000, [0] * 1000)
    assert draws.dtype == np.float32 and draws.max() <= MAX_UNIFORM
