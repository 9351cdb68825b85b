"""What this machine offers metalserve, probed once: MLX's device, Metal, numba and the BLAS in use.

Every choice that depends on the machine (the attention backend, the host-compute strategy, the weights
path, the sampler's arrays, the default step budget) reads a `Platform`; no other module asks MLX which
device it runs on. `current_platform()` probes on first use and then returns the same answer.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import sys
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlx.core as mx

MAX_NUM_BATCHED_TOKENS = 2048  # the step token budget (EngineConfig's default) where MLX runs on a GPU
# `metalserve serve`'s token budget where MLX runs on the CPU: steps of up to 512 tokens run on the host
# (executor/host/forward.py), and smaller steps let new prompts start sooner. At concurrency 8
# (bench/compare_peers.py) mean TTFT was 4.4 s at 512 against 7.6 s at 2048, at the same output tok/s.
CPU_MAX_NUM_BATCHED_TOKENS = 512


@dataclass(frozen=True)
class Platform:
    on_cpu: bool  # MLX's default device is the CPU (its CPU backend computes every op)
    metal: bool  # a Metal device is available (a Mac's GPU)
    numba: bool  # the numba package is importable (the CPU attention path and host compute need it)
    blas: str  # which BLAS MLX's CPU backend binds (metalserve/blas.py)
    metal_memory: int | None = None  # the Metal device's (unified) memory in bytes, where there is one

    @property
    def device(self) -> mx.Device:
        """MLX's default device (new threads' streams are made on it)."""
        import mlx.core as mx

        return mx.Device(mx.cpu if self.on_cpu else mx.gpu)

    @property
    def host_compute(self) -> bool:
        """Whether small steps run on the host (executor/host/): on MLX's CPU backend, with numba."""
        return self.on_cpu and self.numba

    def default_token_budget(self) -> int:
        """The step token budget when --max-num-batched-tokens is not given: smaller on MLX's CPU backend,
        where steps of up to 512 tokens run on the host."""
        return CPU_MAX_NUM_BATCHED_TOKENS if self.on_cpu else MAX_NUM_BATCHED_TOKENS

    def describe(self) -> str:
        device = "Metal" if self.metal and not self.on_cpu else "CPU"
        return f"MLX on {device}, numba {'yes' if self.numba else 'no'}, BLAS {self.blas}"


@cache
def current_platform() -> Platform:
    """Probe the machine once (importing MLX, after the BLAS preload in metalserve/__init__.py)."""
    import mlx.core as mx

    from metalserve.blas import blas_description

    metal = bool(mx.metal.is_available())
    memory = int(mx.device_info()["memory_size"]) if metal else None
    return Platform(
        on_cpu=mx.default_device() == mx.cpu,
        metal=metal,
        numba=importlib.util.find_spec("numba") is not None,
        blas=blas_description(),
        metal_memory=memory,
    )


def return_freed_memory() -> None:
    """Linux: hand the freed heap back to the OS (after an unload, a failed load, a burst of traffic). glibc
    keeps freed blocks for reuse, so after an unload the
    server's resident memory stayed ~700 MiB above its start for the default model (malloc_trim: ~100)."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
