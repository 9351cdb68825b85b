"""A CPU emulator for metalserve's Metal kernels: the exact MSL that MLX compiles, built with g++."""

from tools.msl_emulator.build import EmulatorBuildError, cache_dir
from tools.msl_emulator.runner import (
    EmulatorError,
    LaunchCounts,
    emulate,
    emulate_counted,
    emulate_race_checked,
)

__all__ = [
    "EmulatorBuildError",
    "EmulatorError",
    "LaunchCounts",
    "cache_dir",
    "emulate",
    "emulate_counted",
    "emulate_race_checked",
]
