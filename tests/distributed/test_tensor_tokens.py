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
