"""The sampler's filters: each test fails if the parameter it names is ignored."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metalserve.executor.sampler as sampler_module
from metalserve.executor.array_backend import ArrayBackend, pick_backend
from metalserve.executor.block_table import RequestBlockTable
from metalserve.executor.input_batch import CachedRequestState
from metalserve.executor.sampler import Sampler
from metalserve.executor.truncation import NUCLEUS_CANDIDATES
from metalserve.platform import current_platform
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams


@pytest.fixture(autouse=True, params=["mlx", "numpy"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ArrayBackend:
    """Run every test on both array backends: Sampler() then uses this one."""
    chosen = pick_backend(request.param)
    monkeypatch.setattr(sampler_module, "pick_backend", lambda name="auto": chosen)
    return chosen


PROBS = np.array([0.5, 0.3, 0.15, 0.05])
N = 4000  # rows per statistical check: one call, many independent unseeded draws


def req(prompt: list[int] | None = None, output: list[int] | None = None, eos: tuple[int, ...] = (), **kw):
    return Request(
        request_id="r",
        prompt_token_ids=prompt or [0],
        sampling_params=SamplingParams(**kw),
        eos_token_ids=frozenset(eos),
        output_token_ids=list(output or []),
    )


def draw(probs: np.ndarray, n: int = N, seed: int = 0, **kw) -> np.ndarray:
    """n unseeded draws from one logit row, as token counts per vocabulary entry."""
    logits = mx.array(np.tile(np.log(probs), (n, 1)).astype(np.float32))
    tokens = Sampler(seed)(logits, [req(**kw)] * n).token_ids
    return np.bincount(tokens, minlength=len(probs)) / n


def test_rejects_bad_logits() -> None:
    sampler = Sampler()
    with pytest.raises(ValueError, match="batch, vocab"):
        sampler(mx.zeros((4,)), [req()])
    with pytest.raises(ValueError, match="2 rows but 1 requests"):
        sampler(mx.zeros((2, 4)), [req()])
    with pytest.raises(ValueError, match="float"):
        sampler(mx.zeros((1, 4), dtype=mx.int32), [req()])
    with pytest.raises(ValueError, match="empty vocabulary"):
        sampler(mx.zeros((1, 0)), [req()])


def test_empty_batch_gives_empty_output() -> None:
    out = Sampler()(mx.zeros((0, 4)), [])
    assert out.token_ids == [] and out.logprobs == []


def test_accepts_the_runners_request_state() -> None:
    state = CachedRequestState(
        request_id="a",
        token_ids=[1, 2, 3, 3],
        num_prompt_tokens=2,
        sampling_params=SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=1),
        blocks=RequestBlockTable([[]]),
        num_computed_tokens=0,
        eos_token_ids=frozenset({0}),
    )
    out = Sampler()(mx.array([[0.0, 0.0, 2.9, 3.0]]), [state])
    assert out.token_ids == [2]  # token 3 was generated, so presence drops it below token 2
    assert out.logprobs[0] is not None and out.logprobs[0].top[0][0] == 3


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_greedy_is_argmax_for_every_row(dtype: mx.Dtype) -> None:
    logits = mx.array(np.random.default_rng(0).normal(size=(5, 37)).astype(np.float32)).astype(dtype)
    out = Sampler()(logits, [req(temperature=0.0)] * 5)
    assert out.token_ids == np.argmax(np.array(logits.astype(mx.float32)), axis=-1).tolist()
    assert out.logprobs == [None] * 5


@pytest.mark.parametrize("backend", ["numpy", "mlx"])
def test_greedy_takes_the_first_of_tied_logits_on_either_backend(backend: str) -> None:
    logits = mx.array([[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    assert Sampler(backend=backend)(logits, [req(temperature=0.0)] * 2).token_ids == [1, 0]


def test_temperature_one_follows_softmax() -> None:
    assert np.abs(draw(PROBS, temperature=1.0) - PROBS).max() < 0.03


def test_temperature_sharpens_and_flattens() -> None:
    cold = draw(PROBS, temperature=0.05)
    hot = draw(PROBS, temperature=50.0)
    assert cold[0] > 0.99
    assert np.abs(hot - 0.25).max() < 0.03  # nearly uniform


def test_top_k_one_is_argmax() -> None:
    logits = mx.array(np.random.default_rng(1).normal(size=(64, 50)).astype(np.float32))
    out = Sampler()(logits, [req(temperature=1.0, top_k=1)] * 64)
    assert out.token_ids == np.argmax(np.array(logits), axis=-1).tolist()


def test_top_k_keeps_k_best_renormalised() -> None:
    freq = draw(PROBS, top_k=2)
    assert freq[2:].sum() == 0
    assert abs(freq[0] - 0.5 / 0.8) < 0.03


def test_top_p_removes_tail() -> None:
    freq = draw(PROBS, top_p=0.7)  # 0.5 alone is below 0.7, so the nucleus is tokens 0 and 1
    assert freq[2:].sum() == 0
    assert abs(freq[0] - 0.5 / 0.8) < 0.03


def test_top_p_keeps_at_least_one_token() -> None:
    assert draw(PROBS, top_p=0.01)[0] == 1.0


def test_top_p_with_top_k_uses_both() -> None:
    freq = draw(PROBS, top_k=3, top_p=0.9)  # top-3 renormalised: 0.526, 0.316, 0.158 -> 0.842 < 0.9
    assert freq[3] == 0 and freq[2] > 0.1
    freq = draw(PROBS, top_k=3, top_p=0.8)  # nucleus now ends at token 1
    assert freq[2:].sum() == 0


def test_top_k_and_top_p_rows_batched_with_plain_top_p_rows() -> None:
    logits = mx.array(np.tile(np.log(PROBS).astype(np.float32), (3 * N, 1)))
    rows = [req(top_k=3, top_p=0.8), req(top_p=0.9), req(top_k=3)] * N
    tokens = np.array(Sampler()(logits, rows).token_ids).reshape(N, 3)
    freq = [np.bincount(tokens[:, j], minlength=4) / N for j in range(3)]
    assert freq[0][2:].sum() == 0  # top-k 3 then nucleus 0.8: tokens 0 and 1
    assert freq[1][3] == 0 and freq[1][2] > 0.1  # nucleus 0.9 of the full row: tokens 0, 1, 2
    assert freq[2][3] == 0 and abs(freq[2][2] - 0.15 / 0.95) < 0.03


def test_top_p_wider_than_candidates_widens_to_vocabulary() -> None:
    vocab = 4 * NUCLEUS_CANDIDATES
    logits = np.linspace(0.0, -1.0, vocab)  # nearly flat: the 0.5 nucleus is ~half the vocabulary
    probs = np.exp(logits) / np.exp(logits).sum()
    allowed = int(np.sum(np.cumsum(probs) - probs < 0.5))
    assert allowed > NUCLEUS_CANDIDATES
    counts = draw(probs, top_p=0.5)
    assert counts[allowed + 1 :].sum() == 0
    assert counts[NUCLEUS_CANDIDATES:allowed].sum() > 0.2


def test_min_p_removes_tail() -> None:
    freq = draw(PROBS, min_p=0.2)  # threshold 0.2 * 0.5 = 0.1 drops token 3 only
    assert freq[3] == 0
    assert abs(freq[2] - 0.15 / 0.95) < 0.03


def test_logit_bias_forces_and_bans() -> None:
    logits = mx.array(np.log(PROBS)[None].astype(np.float32))
    assert Sampler()(logits, [req(temperature=0.0, logit_bias={3: 100.0})]).token_ids == [3]
    assert Sampler()(logits, [req(temperature=1.0, logit_bias={2: 100.0})]).token_ids == [2]
    assert draw(PROBS, logit_bias={0: -100.0})[0] == 0


def test_logit_bias_outside_vocabulary_is_an_error() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler()(mx.zeros((1, 4)), [req(logit_bias={4: 1.0})])


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = mx.array([[5.0, 4.0, 3.0, 0.0]])  # EOS (0) then a stop id (1) are the best tokens
    sampler = Sampler()
    early = req(eos=(0,), output=[3], temperature=0.0, min_tokens=2, stop_token_ids=[1])
    assert sampler(logits, [early]).token_ids == [2]
    done = req(eos=(0,), output=[3, 3], temperature=0.0, min_tokens=2, stop_token_ids=[1])
    assert sampler(logits, [done]).token_ids == [0]
    ignore = req(eos=(0,), output=[3], temperature=0.0, min_tokens=2, stop_token_ids=[1], ignore_eos=True)
    assert sampler(logits, [ignore]).token_ids == [0]


def test_min_tokens_masks_in_random_sampling() -> None:
    freq = draw(PROBS, eos=(0,), min_tokens=1)
    assert freq[0] == 0 and freq[1] > 0.5


def test_mixed_batch_applies_each_rows_own_parameters() -> None:
    logits = mx.array(np.tile(np.log(PROBS).astype(np.float32), (4, 1)))
    rows = [
        req(temperature=0.0),
        req(temperature=1.0, logit_bias={3: 100.0}),
        req(temperature=0.0, logit_bias={2: 100.0}),
        req(temperature=1.0, top_k=1),
    ]
    for _ in range(20):
        assert Sampler()(logits, rows).token_ids == [0, 3, 2, 0]


def test_backend_choice() -> None:
    assert pick_backend("mlx").name == "mlx"
    assert pick_backend("numpy").name == "numpy"
    expected = "numpy" if current_platform().on_cpu else "mlx"
    assert pick_backend("auto").name == expected
    with pytest.raises(ValueError, match="unknown sampler backend"):
        pick_backend("torch")


def test_backends_agree_on_a_mixed_batch() -> None:
    rng = np.random.default_rng(3)
    logits = mx.array(rng.normal(scale=3.0, size=(6, 300)).astype(np.float32))
    rows = [
        req(temperature=0.0, logprobs=3, repetition_penalty=1.2, output=[5, 6]),
        req(temperature=0.7, top_k=20, top_p=0.8, seed=1, logprobs=2, output=[1]),
        req(temperature=1.3, min_p=0.05, seed=2, frequency_penalty=0.5, output=[7, 7]),
        req(temperature=1.0, top_p=0.95, seed=3, logit_bias={4: 2.0}),
        req(temperature=0.9, seed=4, eos=(0,), min_tokens=3),
        req(temperature=0.0, presence_penalty=1.0, output=[9]),
    ]
    by_mlx = Sampler(0, backend="mlx")(logits, rows)
    by_numpy = Sampler(0, backend="numpy")(logits, rows)
    assert by_mlx.token_ids == by_numpy.token_ids
    for a, b in zip(by_mlx.logprobs, by_numpy.logprobs, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
