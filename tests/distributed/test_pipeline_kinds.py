"""Greedy tokens through 2 local ranks (the ring backend) equal one process for every KV kind: a
sliding-window model of three layer groups, a hybrid with recurrent states and an MLA model; with
staggered requests, chunked prefill and prefix caching on (tests/distributed/drive.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.drive import reference_tokens
from tests.distributed.test_pipeline_tokens import SPEC, run_pipeline

pytestmark = pytest.mark.slow  # each starts two ranks that load the model: 20-40 s


def test_sliding_window_groups_over_two_ranks(tiny_gemma3: Path, tmp_path: Path) -> None:
    spec = {**SPEC, "model": str(tiny_gemma3), "pp": 2}
    got = run_pipeline(spec, tmp_path)
    assert got["prefix_hits"] > 0
    assert got["tokens"] == reference_tokens(spec)
    assert "KV cache layer groups: FullAttention x2, SlidingWindow x2, SlidingWindow x2" in got["log"]
    # A request holds blocks in all three groups: the cap is --max-num-seqs 64 x 3 x 512 / 8 tokens, + 1.
    assert "pipeline KV pool: up to 12289 blocks of 8 tokens" in got["log"]


def test_a_hybrid_with_recurrent_states_over_two_ranks(tiny_qwen3_next: Path, tmp_path: Path) -> None:
    spec = {**SPEC, "model": str(tiny_qwen3_next), "pp": 2}
    got = run_pipeline(spec, tmp_path)
    assert got["prefix_hits"] > 0  # resumed from state snapshots at block boundaries
    assert got["tokens"] == reference_tokens(spec)


def test_a_hybrid_whose_backbone_is_elsewhere_over_two_ranks(tiny_nemotron_h: Path, tmp_path: Path) -> None:
    spec = {**SPEC, "model": str(tiny_nemotron_h), "pp": 2}
    got = run_pipeline(spec, tmp_path)
    assert got["prefix_hits"] > 0
    assert got["tokens"] == reference_tokens(spec)


def test_mla_latent_pages_over_two_ranks(tiny_deepseek_v3: Path, tmp_path: Path) -> None:
    spec = {**SPEC, "model": str(tiny_deepseek_v3), "pp": 2}
    got = run_pipeline(spec, tmp_path)
    assert got["prefix_hits"] > 0
    assert got["tokens"] == reference_tokens(spec)
