"""Greedy tokens through 2 local tensor-parallel ranks (ring backend) equal one process on the same
generic MLX path, with staggered concurrent requests, chunked prefill and prefix caching on. The
all-reduces sum each layer's partial products in another order than one process does, so the logits
differ in the last bits; the tiny models' peaky weights keep greedy choices apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.drive import reference_tokens
from tests.distributed.test_pipeline_tokens import SPEC, run_pipeline
from tests.distributed.tiny_dir import write_tiny_dir


def test_two_tensor_parallel_ranks_match_one_process(tiny_llama: Path, tmp_path: Path) -> None:
    spec = {**SPEC, "model": str(tiny_llama), "tp": 2}
    got = run_pipeline(spec, tmp_path)
    assert got["prefix_hits"] > 0
    assert got["tokens"] == reference_tokens(spec)
    # Each rank's pool holds its own KV head of the two: half the bytes per block of one process's.
    assert "tensor-parallel rank 0: KV heads 0-0 of every layer, weights 0 MiB, KV 4.0 KiB per block" in got["log"]
    assert "tensor-parallel rank 1: KV heads 1-1 of every layer" in got["log"]
    assert "tensor-parallel rank 1: stopped by rank 0 after" in got["log"]


def test_a_hybrid_with_recurrent_states_at_tp2(tiny_qwen3_5: Path, tmp_path: Path) -> None:
    """qwen3_5: each rank's gated delta nets keep their own heads' recurrent states (resumed from
    snapshots at block boundaries on prefix hits), its attention layers their own KV heads."""
    spec = {**SPEC, "model": str(tiny_qwen3_5), "tp": 2}
    got = run_pipeline(spec, tmp_path)
    assert got["prefix_hits"] > 0
    assert got["tokens"] == reference_tokens(spec)
    assert "tensor-parallel rank 1: KV heads 1-1 of every layer" in got["log"]


@pytest.mark.slow
def test_sliding_window_groups_at_tp2(tiny_gemma3: Path, tmp_path: Path) -> None:
    """gemma3_text (split by shard.py itself): three layer groups, each rank its own KV heads of each."""
    spec = {**SPEC, "model": str(tiny_gemma3), "tp": 2}
    got = run_pipeline(spec, tmp_path)
    assert got["prefix_hits"] > 0
    assert got["tokens"] == reference_tokens(spec)
    assert "KV cache layer groups: FullAttention x2, SlidingWindow x2, SlidingWindow x2" in got["log"]


@pytest.mark.slow  # 4 ranks: ~30 s
def test_tensor_parallel_pairs_inside_two_pipeline_stages(tiny_llama: Path, tmp_path: Path) -> None:
    """TP 2 x PP 2 over 4 local ranks (ring backend: no sub-groups, each stage's pair sums over send/recv):
    world ranks 0-1 hold layers 0-1 split by heads, ranks 2-3 layers 2-3."""
    spec = {**SPEC, "model": str(tiny_llama), "tp": 2, "pp": 2}
    got = run_pipeline(spec, tmp_path)
    assert got["prefix_hits"] > 0
    assert got["tokens"] == reference_tokens(spec)
    assert "pipeline rank 1: layers 0-1 (2)" in got["log"] and "pipeline rank 3: layers 2-3 (2)" in got["log"]
    # Each rank's pool holds one KV head of two: half of a lone pipeline stage's 4.0 KiB per block.
    assert "pipeline rank 0: layers 0-1 (2), weights 0 MiB, KV 2.0 KiB per block" in got["log"]


@pytest.mark.slow
def test_qwen3_at_tp2(tiny_qwen3: Path, tmp_path: Path) -> None:
    spec = {**SPEC, "model": str(tiny_qwen3), "tp": 2}
    got = run_pipeline(spec, tmp_path)
    assert got["prefix_hits"] > 0
    assert got["tokens"] == reference_tokens(spec)


@pytest.mark.slow
def test_moe_at_tp2_experts_split_by_column(tiny_qwen3_moe: Path, tmp_path: Path) -> None:
    spec = {**SPEC, "model": str(tiny_qwen3_moe), "tp": 2}
    got = run_pipeline(spec, tmp_path)
    assert got["prefix_hits"] > 0
    assert got["tokens"] == reference_tokens(spec)


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["quantized", "dequantize"])
def test_4bit_checkpoint_at_tp2(tmp_path: Path, weights: str) -> None:
    """A 4-bit checkpoint split while packed: kept packed (the Mac route's weights) or dequantized after
    the split (the CPU's)."""
    model = write_tiny_dir(tmp_path / "q4", "llama", seed=0, layers=4, quantize_bits=4)
    spec = {**SPEC, "model": str(model), "tp": 2, "weights": weights}
    got = run_pipeline(spec, tmp_path)
    assert got["tokens"] == reference_tokens(spec)


@pytest.mark.slow
def test_a_hybrid_at_tp2_inside_two_pipeline_stages(tiny_qwen3_5: Path, tmp_path: Path) -> None:
    """qwen3_5 at TP 2 x PP 2: each stage's pair splits its gated delta nets' heads and states."""
    spec = {**SPEC, "model": str(tiny_qwen3_5), "tp": 2, "pp": 2}
    got = run_pipeline(spec, tmp_path)
    assert got["prefix_hits"] > 0
    assert got["tokens"] == reference_tokens(spec)
