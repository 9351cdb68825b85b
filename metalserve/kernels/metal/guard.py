"""Launches the device may refuse, found once: each new kernel instance is evaluated on its first launch.

A Metal pipeline's thread limit depends on the registers Apple's compiler gave it, which nothing can
query from MLX; a threadgroup above it throws when the graph is evaluated, at the end of the step, too
late to choose another launch. So the first launch of each kernel instance (name, template constants,
threadgroup size) is evaluated at once: accepted, it runs lazily from then on; refused, every later
launch of it raises `LaunchRefused` without touching the device, and the caller takes the next smaller
tile, the decode kernel or the MLX-ops path (paged.py, executor/attention/metal.py). One sync per
instance per process. Only a refusal (threadgroup size or memory) is remembered: any other error (out of
memory, say) propagates as it is and the launch is tried again next time.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import mlx.core as mx

from metalserve.kernels.metal.launch import KernelLaunch

Executor = Callable[[KernelLaunch], list[mx.array]]
LaunchKey = tuple[str, tuple[tuple[str, object], ...], tuple[int, int, int]]


class LaunchRefused(RuntimeError):
    """The device would not run this launch. `first`: this call found it out (the caller warns once)."""

    def __init__(self, message: str, first: bool) -> None:
        super().__init__(message)
        self.first = first


# What MLX raises for a launch the pipeline cannot take: a threadgroup above the pipeline's thread limit
# (mlx/backend/metal/custom_kernel.cpp: "Thread group size (N) is greater than the maximum allowed threads
# per threadgroup (M)."), or threadgroup memory beyond the device's (Metal's pipeline error, which MLX
# passes on when it cannot load the kernel).
_REFUSAL = re.compile(r"thread ?group size|threads per thread ?group|thread ?group memory", re.IGNORECASE)


def is_launch_refusal(exc: BaseException) -> bool:
    """Whether `exc` is the device refusing a launch's threadgroup size or memory (and nothing else)."""
    return bool(_REFUSAL.search(str(exc)))


def launch_key(launch: KernelLaunch) -> LaunchKey:
    template = tuple((name, str(value)) for name, value in launch.template)
    return launch.name, template, launch.threadgroup


def describe(launch: KernelLaunch) -> str:
    constants = ", ".join(f"{name}={str(value).removeprefix('mlx.core.')}" for name, value in launch.template)
    threads = launch.threadgroup[0] * launch.threadgroup[1] * launch.threadgroup[2]
    return f"{launch.name} with {threads}-thread threadgroups ({constants})"


class LaunchGuard:
    """An executor that evaluates each kernel instance's first launch, and remembers the verdict."""

    def __init__(self, execute: Executor) -> None:
        self.execute = execute
        self.accepted: set[LaunchKey] = set()
        self.refused: dict[LaunchKey, str] = {}

    def __call__(self, launch: KernelLaunch) -> list[mx.array]:
        key = launch_key(launch)
        if key in self.accepted:
            return self.execute(launch)
        if key in self.refused:
            raise LaunchRefused(self.refused[key], first=False)
        try:
            outputs = self.execute(launch)
            mx.eval(outputs)
        except (RuntimeError, ValueError) as exc:
            if not is_launch_refusal(exc):
                raise  # out of memory, a bad input, a compile error: not this launch's size, not remembered
            self.refused[key] = f"the device refused {describe(launch)}: {exc}"
            raise LaunchRefused(self.refused[key], first=True) from exc
        self.accepted.add(key)
        return outputs
