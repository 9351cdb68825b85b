"""Logprobs: log_softmax of the raw logits, the sampled token's value and the top-n best first."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metalserve.executor.sampler as sampler_module
from metalserve.executor.array_backend import ArrayBackend, pick_backend
from metalserve.executor.sampler import Sampler
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams


@pytest.fixture(autouse=True, params=["mlx", "numpy"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ArrayBackend:
    """Run every test on both array backends: Sampler() then uses this one."""
    chosen = pick_backend(request.param)
    monkeypatch.setattr(sampler_module, "pick_backend", lambda name="auto": chosen)
    return chosen


def log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def req(**kw) -> Request:
    return Request("r", [0, 1], SamplingParams(**kw), output_token_ids=[2])


def test_logprobs_match_numpy_log_softmax_of_raw_logits() -> None:
    rng = np.random.default_rng(0)
    raw = rng.normal(scale=3.0, size=(4, 40)).astype(np.float32)
    requests = [
        req(temperature=0.0, logprobs=5),
        req(temperature=0.5, logprobs=3, repetition_penalty=1.7, logit_bias={7: 3.0}),
        req(temperature=1.0),
        req(temperature=1.0, logprobs=0, top_k=4),
    ]
    out = Sampler()(mx.array(raw), requests)
    expected = log_softmax(raw.astype(np.float64))
    assert out.logprobs[2] is None
    for row, n in ((0, 5), (1, 3), (3, 0)):
        lp = out.logprobs[row]
        assert lp is not None and lp.token_id == out.token_ids[row]
        assert lp.logprob == pytest.approx(expected[row, lp.token_id], abs=1e-4)
        best = np.argsort(-expected[row])[:n]
        assert [t for t, _ in lp.top] == best.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], expected[row, best], atol=1e-4)


def test_logprobs_ignore_penalties_and_bias() -> None:
    raw = np.array([[1.0, 2.0, 0.5]], dtype=np.float32)
    plain = Sampler()(mx.array(raw), [req(temperature=0.0, logprobs=2)]).logprobs[0]
    biased = Sampler()(mx.array(raw), [req(temperature=0.0, logprobs=2, logit_bias={0: 50.0})]).logprobs[0]
    assert plain is not None and biased is not None
    assert biased.token_id == 0 and plain.token_id == 1
    assert biased.top == plain.top
    assert biased.logprob == pytest.approx(log_softmax(raw)[0, 0], abs=1e-5)


def test_logprobs_from_half_precision_logits() -> None:
    raw = np.random.default_rng(1).normal(size=(2, 64)).astype(np.float32)
    out = Sampler()(mx.array(raw).astype(mx.bfloat16), [req(temperature=0.0, logprobs=20)] * 2)
    expected = log_softmax(np.array(mx.array(raw).astype(mx.bfloat16).astype(mx.float32)))
    for row in range(2):
        lp = out.logprobs[row]
        assert lp is not None and len(lp.top) == 20
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.top[0] == (int(np.argmax(expected[row])), pytest.approx(expected[row].max(), abs=1e-3))


def test_top_n_larger_than_the_vocabulary_lists_every_token() -> None:
    raw = np.array([[0.5, 2.0, 1.0]], dtype=np.float32)
    lp = Sampler()(mx.array(raw), [req(temperature=0.0, logprobs=5)]).logprobs[0]
    assert lp is not None and [t for t, _ in lp.top] == [1, 2, 0]


def test_logprobs_of_many_rows() -> None:
    raw = np.random.default_rng(2).normal(scale=2.0, size=(21, 50)).astype(np.float32)
    out = Sampler()(mx.array(raw), [req(temperature=0.0, logprobs=2)] * 21)
    expected = log_softmax(raw.astype(np.float64))
    for row, lp in enumerate(out.logprobs):
        assert lp is not None and lp.token_id == int(np.argmax(raw[row]))
        assert lp.logprob == pytest.approx(expected[row].max(), abs=1e-4)
        assert [t for t, _ in lp.top] == np.argsort(-expected[row])[:2].tolist()
