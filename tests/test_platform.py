"""The Platform: probed once, and the only module that asks MLX which device it runs on."""

from __future__ import annotations

import re
from pathlib import Path

from metalserve.platform import Platform, current_platform

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


def test_the_machine_is_probed_once() -> None:
    assert current_platform() is current_platform()


def test_no_other_module_probes_the_device() -> None:
    found = [
        name
        for name, text in _sources().items()
        if PROBE.search(text) and name not in PROBE_EXCEPTIONS
    ]
    assert found == []


def test_api_imports_no_mlx_and_kernels_nothing_from_the_loader() -> None:
    sources = _sources()
    mlx_import = re.compile(r"^\s*(import|from) mlx", re.M)
    assert [n for n, t in sources.items() if n.startswith("api/") and mlx_import.search(t)] == []
    assert [n for n, t in sources.items() if n.startswith("kernels/") and "metalserve.loader" in t] == []
