"""One `mx.fast.metal_kernel` call, described as data so Metal and the CPU emulator run the same thing."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import mlx.core as mx

TemplateValue = mx.Dtype | int | bool
Scalar = int | float | bool
KERNEL_DIR = Path(__file__).resolve().parent


@cache
def metal_source(name: str) -> str:
    """The body of `kernels/metal/<name>.metal`, exactly as handed to `mx.fast.metal_kernel`."""
    return (KERNEL_DIR / f"{name}.metal").read_text()


@dataclass(frozen=True)
class KernelLaunch:
    """Everything `mx.fast.metal_kernel(...)(...)` takes: the kernel's definition and one call of it."""

    name: str
    source: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    inputs: tuple[mx.array | Scalar, ...]
    output_shapes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[mx.Dtype, ...]
    template: tuple[tuple[str, TemplateValue], ...]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    header: str = ""
    atomic_outputs: bool = False
    init_value: float | None = None

    def __post_init__(self) -> None:
        if len(self.inputs) != len(self.input_names):
            raise ValueError(f"{self.name}: {len(self.inputs)} inputs for {len(self.input_names)} names")
        if not len(self.output_shapes) == len(self.output_dtypes) == len(self.output_names):
            raise ValueError(f"{self.name}: output names, shapes and dtypes differ in length")


def as_array(value: mx.array | Scalar) -> mx.array:
    """How MLX passes a Python scalar input: a 0-d int32, float32 or bool array."""
    if isinstance(value, mx.array):
        return value
    if isinstance(value, bool):
        return mx.array(value, dtype=mx.bool_)
    if isinstance(value, int):
        return mx.array(value, dtype=mx.int32)
    return mx.array(value, dtype=mx.float32)
