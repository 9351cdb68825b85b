"""The Platform: probed once, and the only module that asks MLX which device it runs on."""

from __future__ import annotations

import argparse
import asyncio
import re
import threading
from pathlib import Path

import pytest

from metalserve import blas
from metalserve.api.server import add_cli_args, config_from_args
from metalserve.platform import Platform, current_platform
from metalserve.sampling_params import SamplingParams
from metalserve.serving.engine_loader import start_engine
from metalserve.serving.model_spec import ModelSpec
from tests.e2e.family_dirs import write_model_dir

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

PACKAGE = Path(__file__).parents[1] / "metalserve"
PROBE_EXCEPTIONS = {"platform.py"}
PROBE = re.compile(r"default_device\(\)|metal\.is_available\(\)|find_spec\(\"numba\"\)")


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in PACKAGE.rglob("*.py")}


def test_host_compute_and_the_token_budget_follow_the_device() -> None:
    cpu = Platform(on_cpu=True, metal=False, numba=True, blas="x")
    assert cpu.host_compute and cpu.default_token_budget() == 512
    assert not Platform(on_cpu=True, metal=False, numba=False, blas="x").host_compute
    mac = Platform(on_cpu=False, metal=True, numba=True, blas="x", metal_memory=1)
    assert not mac.host_compute and mac.default_token_budget() == 2048


def test_the_server_start_up_probes_the_machine_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`metalserve serve`'s start-up (flags -> configs -> load -> core on the engine thread) and a request's
    steps ask the Platform in several modules; the machine is probed once, on the first ask."""
    probes: list[int] = []
    real = blas.blas_description
    monkeypatch.setattr(blas, "blas_description", lambda: probes.append(threading.get_ident()) or real())
    model = write_model_dir(tmp_path / "llama", "llama")
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    current_platform.cache_clear()  # what an earlier test probed (and its counts) do not count here

    async def serve_one() -> list[int]:
        config, _ = config_from_args(parser.parse_args([str(model), "--kv-cache-memory", "4194304"]))
        engine = start_engine(ModelSpec.of(config))
        try:
            return [t async for out in engine.generate([5, 6, 7], GREEDY, "r") for t in out.token_ids]
        finally:
            await engine.shutdown()

    assert len(asyncio.run(serve_one())) == GREEDY.max_tokens
    assert probes == [threading.get_ident()]  # the flags asked first (the default token budget), here
    asked = current_platform.cache_info()
    assert asked.misses == 1 and asked.hits >= 3  # the flags, then the loader, the core, the KV plan, ...


def test_no_other_module_probes_the_device() -> None:
    found = [name for name, text in _sources().items() if PROBE.search(text) and name not in PROBE_EXCEPTIONS]
    assert found == []


def test_api_imports_no_mlx_and_kernels_nothing_from_the_loader() -> None:
    sources = _sources()
    mlx_import = re.compile(r"^\s*(import|from) mlx", re.M)
    assert [n for n, t in sources.items() if n.startswith("api/") and mlx_import.search(t)] == []
    assert [n for n, t in sources.items() if n.startswith("kernels/") and "metalserve.loader" in t] == []
