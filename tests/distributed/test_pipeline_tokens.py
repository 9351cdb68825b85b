"""Greedy tokens through 2 and 3 local ranks equal one process on the same generic MLX path (not the
numba host forward, which runs whole dense models in one process only), with staggered concurrent
requests, chunked prefill (a 24-token budget under 30-40-token prompts) and prefix caching on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.drive import reference_tokens

SPEC = {"prefix_len": 40, "num_requests": 5, "max_tokens": 12, "budget": 24, "stagger": 2}


def run_pipeline(spec: dict[str, Any], tmp_path: Path, timeout: float = 240) -> dict[str, Any]:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.distributed.drive", str(path)], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["log"] = proc.stderr
    return result


def test_two_ranks_match_one_process(tiny_llama: Path, tmp_path: Path) -> None:
    spec = {**SPEC, "model": str(tiny_llama), "pp": 2}
    got = run_pipeline(spec, tmp_path)
    assert got["prefix_hits"] > 0  # later prompts reused the shared prefix's blocks
    assert got["tokens"] == reference_tokens(spec)
    # The start-up log: each rank's layers, weights and KV room; the pool is the smallest room.
    assert "pipeline rank 0: layers 0-1 (2), weights 0 MiB, KV 4.0 KiB per block, room for 16384" in got["log"]
    assert "pipeline rank 1: layers 2-3 (2)" in got["log"]
    assert "pipeline KV pool: up to 4097 blocks of 8 tokens" in got["log"]  # capped by --max-num-seqs


@pytest.mark.slow
def test_three_ranks_second_architecture(tiny_qwen3: Path, tmp_path: Path) -> None:
    spec = {**SPEC, "model": str(tiny_qwen3), "pp": 3}
    got = run_pipeline(spec, tmp_path)
    assert got["prefix_hits"] > 0
    assert got["tokens"] == reference_tokens(spec)


@pytest.mark.slow
def test_two_ranks_of_a_moe_model(tiny_qwen3_moe: Path, tmp_path: Path) -> None:
    spec = {**SPEC, "model": str(tiny_qwen3_moe), "pp": 2}
    got = run_pipeline(spec, tmp_path)
    assert got["prefix_hits"] > 0
    assert got["tokens"] == reference_tokens(spec)


@pytest.mark.slow
def test_default_model_pipeline(tmp_path: Path) -> None:
    spec = {**SPEC, "model": None, "pp": 2, "max_tokens": 8, "budget": 32, "num_requests": 4}
    got = run_pipeline(spec, tmp_path, timeout=500)
    assert got["tokens"] == reference_tokens(spec)
