"""The default model through the packed paged runner: token-for-token equal to mlx-lm, and it knows Paris."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from metalserve.executor.host import paged_model
from metalserve.executor.host.compute import HostCompute
from metalserve.executor.models.adapter import PagedModel
from metalserve.executor.models.families import kv_cache_spec, kv_shape
from metalserve.executor.runner import ModelRunner
from metalserve.executor.sampler import Sampler
from metalserve.loader import LoadedModel, load_model
from metalserve.platform import current_platform
from metalserve.sampling_params import SamplingParams
from tests.executor.simple_driver import run_to_completion
from tests.executor.test_runner_golden import mlx_lm_greedy

pytestmark = pytest.mark.slow
NUM_TOKENS = 32
LENGTHS = [7, 60, 23, 3, 41, 90, 15, 33]


@pytest.fixture(scope="module")
def golden() -> tuple[LoadedModel, PagedModel, list[list[int]], list[list[int]]]:
    loaded = load_model(None)
    rng = np.random.default_rng(7)
    text_ids = loaded.tokenizer.encode(" ".join(["the cat sat on a mat and looked at the sea"] * 12))
    prompts = [text_ids[int(o) : int(o) + n] for o, n in zip(rng.integers(0, 20, len(LENGTHS)), LENGTHS, strict=True)]
    # mlx-lm first, while the model still has its own attention layers.
    expected = [mlx_lm_greedy(loaded.model, p, NUM_TOKENS) for p in prompts]
    return loaded, paged_model(loaded, current_platform()), prompts, expected


def runner_for(loaded: LoadedModel, model: PagedModel) -> ModelRunner:
    spec = kv_cache_spec(loaded, 16, num_blocks=128)
    return ModelRunner(model, spec, sampler=Sampler(0))  # MLX ops attend; the projections read the codes


def greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True) for _ in range(n)]


def test_one_request_equals_mlx_lm(golden) -> None:  # type: ignore[no-untyped-def]
    loaded, model, prompts, expected = golden
    assert run_to_completion(runner_for(loaded, model), prompts[1:2], greedy(1)) == expected[1:2]


@pytest.mark.skipif(not current_platform().host_compute, reason="host compute is for MLX's CPU backend")
def test_on_the_cpu_small_steps_read_the_stored_4_bit_codes(golden) -> None:  # type: ignore[no-untyped-def]
    """The Q4_1 GGUF is kept in its packed codes, and no fp32 copy: the goldens above decode through them."""
    loaded, model, _, _ = golden
    assert isinstance(model.compute, HostCompute)
    assert model.compute.linears == 4 * kv_shape(loaded).num_layers  # qkv, o, gate+up, down
    head = model.compute.head_codes
    assert head is not None and [p.shape for p in head.parts] == [(49152, 576)]
    assert "kept in its codes" in loaded.weights_desc


@pytest.mark.parametrize("chunk_size", [1 << 30, 16])
def test_eight_requests_in_the_same_steps_equal_mlx_lm(golden, chunk_size: int) -> None:  # type: ignore[no-untyped-def]
    loaded, model, prompts, expected = golden
    got = run_to_completion(runner_for(loaded, model), prompts, greedy(len(prompts)), chunk_size=chunk_size)
    assert got == expected
    mx.clear_cache()


def test_generate_command_answers_paris() -> None:
    cmd = [
        sys.executable,
        "-m",
        "metalserve.cli",
        "generate",
        "--chat",
        "What is the capital of France?",
        "--max-tokens",
        "16",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_generate_command_rejects_a_prompt_longer_than_the_context() -> None:
    cmd = [sys.executable, "-m", "metalserve.cli", "generate", "--prompt", "hi " * 9000, "--max-tokens", "4"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "error:" in out.stderr and "context" in out.stderr and "Traceback" not in out.stderr
