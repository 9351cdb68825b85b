"""At temperature 1 with top-p, speculation leaves the output distribution as it is (chi-square).

Two arms of N seeded requests on a 12-token model (its drafts come from prompt lookup, so windows are
both accepted and rejected): the per-position token counts of positions 1..4 must be homogeneous
between the arm with speculation and the arm without (different seeds). Each of the four tests has
a false-failure probability of 0.001 (Bonferroni: 0.4% for a random choice of seeds; the seeds are
fixed, so a run is deterministic). A verifier that keeps every draft must fail the same test.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import build_engine_core
from metalserve.spec_decode import verify
from metalserve.speculative_config import SpeculativeConfig
from tests.engine.test_core import tiny_loaded
from tests.executor.tiny_models import tiny_model

N = 500
VOCAB = 12
POSITIONS = (1, 2, 3, 4)
Z_999 = 3.0902  # the standard normal's 0.999 quantile
PROMPT = [1, 2, 3, 4, 5] * 4
NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)


def chi2_critical(df: int) -> float:
    """Wilson-Hilferty: the chi-square quantile at 0.999 (within 1% for df >= 2)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + Z_999 * math.sqrt(h)) ** 3


def homogeneity(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Two-sample chi-square statistic over token bins (bins expected below 5 pooled) and its df."""
    counts = np.stack([np.bincount(a, minlength=VOCAB), np.bincount(b, minlength=VOCAB)])
    expected = counts.sum(axis=0) / 2
    big = expected >= 5
    table = np.concatenate([counts[:, big], counts[:, ~big].sum(axis=1, keepdims=True)], axis=1)
    table = table[:, table.sum(axis=0) > 0]
    exp = table.sum(axis=0, keepdims=True) * table.sum(axis=1, keepdims=True) / table.sum()
    return float(((table - exp) ** 2 / exp).sum()), table.shape[1] - 1


def samples(spec: SpeculativeConfig | None, seed0: int) -> tuple[np.ndarray, EngineCore]:
    loaded = tiny_loaded()
    model = tiny_model("llama", vocab_size=VOCAB)
    model.update(nn.utils.tree_map(lambda p: p / 3.0, model.parameters()))  # a flatter distribution
    mx.eval(model.parameters())
    loaded.model = model
    config = EngineConfig(
        kv_cache_memory=1 << 25, max_num_batched_tokens=4096, max_num_seqs=N, block_size=8, speculative_config=spec
    )
    core = build_engine_core(config, loaded)
    for i in range(N):
        params = SamplingParams(temperature=1.0, top_p=0.85, seed=seed0 + i, max_tokens=5, ignore_eos=True)
        core.add_request(Request(f"s{i}", PROMPT, params))
    out: dict[str, list[int]] = {f"s{i}": [] for i in range(N)}
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    return np.array([out[f"s{i}"] for i in range(N)]), core


def worst_ratio(on: np.ndarray, off: np.ndarray) -> float:
    """The largest statistic / critical value over the positions (above 1: a test failed)."""
    ratios = []
    for pos in POSITIONS:
        stat, df = homogeneity(on[:, pos], off[:, pos])
        ratios.append(stat / chi2_critical(df))
    return max(ratios)


def test_sampling_distribution_is_the_same_with_speculation() -> None:
    off, _ = samples(None, seed0=0)
    on, core = samples(NGRAM, seed0=10_000)
    stats = core.make_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # accepts and rejects
    assert worst_ratio(on, off) < 1.0


def test_a_verifier_that_keeps_every_draft_fails_the_test(monkeypatch: pytest.MonkeyPatch) -> None:
    off, _ = samples(None, seed0=0)
    monkeypatch.setattr(verify, "accept", lambda drafts, targets: len(drafts))
    on, _ = samples(NGRAM, seed0=10_000)
    assert worst_ratio(on, off) > 1.0
