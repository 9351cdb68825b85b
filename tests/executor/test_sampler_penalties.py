"""Repetition, presence and frequency penalties: crafted rows whose argmax a penalty must change."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metalserve.executor.sampler as sampler_module
from metalserve.executor.array_backend import ArrayBackend, pick_backend
from metalserve.executor.penalties import apply_penalties
from metalserve.executor.sampler import Sampler
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams


@pytest.fixture(autouse=True, params=["mlx", "numpy"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ArrayBackend:
    """Run every test on both array backends: Sampler() then uses this one."""
    chosen = pick_backend(request.param)
    monkeypatch.setattr(sampler_module, "pick_backend", lambda name="auto": chosen)
    return chosen


def req(prompt: list[int], output: list[int], **kw) -> Request:
    return Request("r", prompt, SamplingParams(temperature=0.0, **kw), output_token_ids=list(output))


def greedy(row: list[float], request: Request) -> int:
    return Sampler()(mx.array([row]), [request]).token_ids[0]


def test_repetition_penalty_divides_positive_logits_of_prompt_tokens() -> None:
    row = [2.0, 1.9, 0.0]
    assert greedy(row, req([0], [], repetition_penalty=1.0)) == 0
    assert greedy(row, req([0], [], repetition_penalty=1.5)) == 1  # 2.0 / 1.5 < 1.9


def test_repetition_penalty_multiplies_negative_logits_of_output_tokens() -> None:
    row = [-1.0, -1.1, -9.0]
    assert greedy(row, req([2], [0], repetition_penalty=1.5)) == 1  # -1.0 * 1.5 < -1.1


def test_presence_penalty_counts_output_tokens_once_and_ignores_prompt() -> None:
    row = [1.0, 0.5, 0.0]
    assert greedy(row, req([1], [0], presence_penalty=0.6)) == 1  # 1.0 - 0.6 < 0.5
    assert greedy(row, req([1], [0, 0, 0], presence_penalty=0.4)) == 0  # once, not per occurrence
    assert greedy(row, req([0], [], presence_penalty=2.0)) == 0  # prompt tokens are not penalised


def test_frequency_penalty_scales_with_count() -> None:
    row = [1.0, 0.5, 0.0]
    assert greedy(row, req([], [0], frequency_penalty=0.3)) == 0  # 1.0 - 0.3 > 0.5
    assert greedy(row, req([], [0, 0], frequency_penalty=0.3)) == 1  # 1.0 - 0.6 < 0.5


def test_penalties_change_random_sampling_too() -> None:
    n = 2000
    logits = mx.array(np.zeros((n, 2), dtype=np.float32))
    rows = [Request("r", [5], SamplingParams(presence_penalty=2.0), output_token_ids=[0])] * n
    freq = np.bincount(Sampler()(logits, rows).token_ids, minlength=2) / n
    assert abs(freq[0] - 1 / (1 + np.e**2)) < 0.03


def _reference(logits: np.ndarray, requests: list[Request]) -> np.ndarray:
    out = logits.copy()
    vocab = logits.shape[1]
    for i, r in enumerate(requests):
        p = r.sampling_params
        seen = {t for t in r.prompt_token_ids + r.output_token_ids if 0 <= t < vocab}
        for t in seen:
            out[i, t] = out[i, t] / p.repetition_penalty if out[i, t] > 0 else out[i, t] * p.repetition_penalty
        counts = np.bincount([t for t in r.output_token_ids if 0 <= t < vocab], minlength=vocab)
        out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return out


def test_penalties_match_a_dense_reference_per_row(backend: ArrayBackend) -> None:
    rng = np.random.default_rng(0)
    vocab = 30
    logits = rng.normal(size=(4, vocab)).astype(np.float32)
    requests = [
        req(
            rng.integers(0, vocab, 12).tolist(),
            rng.integers(0, vocab, 9).tolist(),
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.2,
        ),
        req([1, 2], [3, 3, 3, 99, -1], frequency_penalty=-0.5),  # out-of-vocabulary ids have no logit
        req([7, 8], [9], repetition_penalty=0.8),
        req([4], [4]),  # no penalties: untouched
    ]
    got = apply_penalties(backend, backend.asarray(logits.copy()), requests, [0, 1, 2])
    np.testing.assert_allclose(np.array(got), _reference(logits, requests), rtol=1e-6, atol=1e-6)


def test_penalties_keep_masked_tokens_masked(backend: ArrayBackend) -> None:
    logits = mx.array([[-np.inf, 1.0, 0.5]], dtype=mx.float32)
    request = req([0], [0, 1], repetition_penalty=2.0, frequency_penalty=1.0)
    got = apply_penalties(backend, backend.asarray(np.array(logits)), [request], [0])
    assert np.array(got)[0, 0] == -np.inf
