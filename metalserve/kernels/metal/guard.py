"""Launches the device may refuse, found once: each new kernel instance is evaluated on its first launch.

A Metal pipeline's thread limit depends on the registers Apple's compiler gave it, which nothing can
query from MLX; a threadgroup above it throws when the graph is evaluated, at the end of the step, too
late to choose another launch. So the first launch of each kernel instance (name, template constants,
threadgroup size) is evaluated at once: accepted, it runs lazily from then on; refused, every later
launch of it raises `LaunchRefused` without touching the device, and the caller takes the next smaller
tile or the MLX-ops path (paged.py, executor/attention/metal.py). One sync per instance per process.
"""

from __future__ import annotations

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
        except (RuntimeError, ValueError) as exc:  # MLX's errors for a pipeline it cannot build or launch
            self.refused[key] = f"the device refused {describe(launch)}: {exc}"
            raise LaunchRefused(self.refused[key], first=True) from exc
        self.accepted.add(key)
        return outputs
