"""Runs a `KernelLaunch` on the CPU: builds it (cached), fills its buffers, calls it through ctypes."""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from metalserve.kernels.metal.launch import KernelLaunch, as_array
from tools.msl_emulator.build import COUNT_NAMES, COUNT_SLOTS, build, entry_symbol
from tools.msl_emulator.signature import GeneratedKernel, generate

STACK_BYTES = 256 * 1024

_NUMPY = {
    mx.float32: np.float32,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,
    mx.float64: np.float64,
    mx.bool_: np.bool_,
    mx.int8: np.int8,
    mx.int16: np.int16,
    mx.int32: np.int32,
    mx.int64: np.int64,
    mx.uint8: np.uint8,
    mx.uint16: np.uint16,
    mx.uint32: np.uint32,
    mx.uint64: np.uint64,
}


class EmulatorError(RuntimeError):
    """The kernel misbehaved under the emulator: divergent barrier, deadlock, race, bad read, ..."""


@dataclass(frozen=True)
class LaunchCounts:
    """What one launch did, summed over its threadgroups: device bytes read per input buffer (by
    name; `<name>_shape` etc. for the extra buffers), threadgroup barriers passed, simdgroup
    collectives completed (matrix loads/stores/fills included) and simdgroup multiply-accumulates."""

    bytes_read: dict[str, int]
    barriers: int
    simd_ops: int
    simd_mma: int


def _counts(kernel: GeneratedKernel, launch: KernelLaunch, raw: np.ndarray) -> LaunchCounts:
    names: dict[str, int] = {}
    slot = 0
    for p in kernel.params:
        if p.kind == "attribute":
            continue
        if p.kind == "input":
            names[launch.input_names[p.index]] = int(raw[slot])
        elif p.kind in ("shape", "strides"):
            names[f"{launch.input_names[p.index]}_{p.kind}"] = int(raw[slot])
        slot += 1
    extra = dict(zip(COUNT_NAMES, (int(v) for v in raw[COUNT_SLOTS:]), strict=True))
    return LaunchCounts(names, **extra)


def to_numpy(a: mx.array) -> np.ndarray:
    """Row-contiguous host copy; bfloat16 travels as its uint16 bits."""
    if a.dtype == mx.bfloat16:
        return np.ascontiguousarray(np.array(a.view(mx.uint16)))
    return np.ascontiguousarray(np.array(a))


def from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(a)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


def _buffers(launch: KernelLaunch, kernel: GeneratedKernel) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Buffers in parameter order, and the outputs among them (poisoned with all-ones bytes = NaN)."""
    arrays = [to_numpy(as_array(v)) for v in launch.inputs]
    outputs: list[np.ndarray] = []
    for shape, dtype in zip(launch.output_shapes, launch.output_dtypes, strict=True):
        out: np.ndarray = np.empty(shape, dtype=_NUMPY[dtype])
        if launch.init_value is None:
            out.view(np.uint8)[...] = 0xFF
        else:
            out[...] = launch.init_value
        outputs.append(out)
    bufs: list[np.ndarray] = []
    for p in kernel.params:
        if p.kind in ("input", "scalar"):
            bufs.append(arrays[p.index])
        elif p.kind == "shape":
            bufs.append(np.array(arrays[p.index].shape, dtype=np.int32))
        elif p.kind == "strides":
            a = arrays[p.index]
            bufs.append(np.array([s // a.itemsize for s in a.strides], dtype=np.int64))
        elif p.kind == "ndim":
            bufs.append(np.array(arrays[p.index].ndim, dtype=np.int32))
        elif p.kind == "output":
            bufs.append(outputs[p.index])
    return bufs, outputs


@cache
def _load(path: Path) -> Any:  # a ctypes function pointer
    """The kernel's entry point in its (possibly shared) library."""
    run = getattr(ctypes.CDLL(str(path)), entry_symbol(path))
    run.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_uint),
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_ulong,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_ulonglong),
    ]
    run.restype = ctypes.c_int
    return run


def default_workers() -> int:
    """OS threads for threadgroups: $METALSERVE_EMULATOR_THREADS, else the usable cores (at most 8)."""
    env = os.environ.get("METALSERVE_EMULATOR_THREADS")
    return int(env) if env else max(1, min(8, len(os.sched_getaffinity(0))))


def _dims(launch: KernelLaunch) -> list[int]:
    return [*launch.grid, *launch.threadgroup]


def _run_in_process(kernel: GeneratedKernel, bufs: list[np.ndarray], launch: KernelLaunch, reverse: bool) -> np.ndarray:
    """Runs the launch; returns the raw counters (msl_rt::Count order)."""
    if len(bufs) > COUNT_SLOTS:
        raise EmulatorError(f"{launch.name}: more than {COUNT_SLOTS} buffers")
    run = _load(build(kernel))
    ptrs = (ctypes.c_void_p * max(1, len(bufs)))(*[b.ctypes.data for b in bufs])
    dims = (ctypes.c_uint * 6)(*_dims(launch))
    err = ctypes.create_string_buffer(4096)
    counts = np.zeros(COUNT_SLOTS + len(COUNT_NAMES), np.uint64)
    rc = run(
        ptrs,
        dims,
        int(reverse),
        default_workers(),
        STACK_BYTES,
        err,
        len(err),
        counts.ctypes.data_as(ctypes.POINTER(ctypes.c_ulonglong)),
    )
    if rc != 0:
        raise EmulatorError(f"{launch.name}: {err.value.decode()}")
    return counts


def _run_asan(kernel: GeneratedKernel, bufs: list[np.ndarray], launch: KernelLaunch, reverse: bool) -> None:
    exe = build(kernel, asan=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.bin", Path(tmp) / "out.bin"
        with src.open("wb") as f:
            f.write(np.uint32(len(bufs)).tobytes())
            for b in bufs:
                f.write(np.uint64(b.nbytes).tobytes())
                f.write(b.tobytes())
            f.write(np.array(_dims(launch), dtype=np.uint32).tobytes())
            f.write(np.int32(reverse).tobytes())
        env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:detect_stack_use_after_return=0")
        result = subprocess.run([str(exe), str(src), str(dst)], capture_output=True, text=True, env=env)
        if result.returncode != 0:
            raise EmulatorError(f"{launch.name} under AddressSanitizer:\n{result.stderr[-4000:]}")
        data = dst.read_bytes()
    offset = 0
    for b in bufs:
        b.view(np.uint8).reshape(-1)[...] = np.frombuffer(data, np.uint8, b.nbytes, offset)
        offset += b.nbytes


def emulate(launch: KernelLaunch, *, reverse: bool = False, asan: bool = False) -> list[mx.array]:
    """Run `launch` like `mx.fast.metal_kernel` would on a GPU; returns the outputs.

    `reverse` starts each threadgroup's threads from the highest index, so a missing barrier shows up
    under one of the two orders; `asan` runs an AddressSanitizer build in a child process.
    """
    kernel = generate(launch)
    bufs, outputs = _buffers(launch, kernel)
    if asan:
        _run_asan(kernel, bufs, launch, reverse)
    else:
        _run_in_process(kernel, bufs, launch, reverse)
    return [from_numpy(o, d) for o, d in zip(outputs, launch.output_dtypes, strict=True)]


def emulate_counted(launch: KernelLaunch) -> tuple[list[mx.array], LaunchCounts]:
    """`emulate`, plus what the launch read and how many barriers and simdgroup operations it ran."""
    kernel = generate(launch)
    bufs, outputs = _buffers(launch, kernel)
    raw = _run_in_process(kernel, bufs, launch, False)
    result = [from_numpy(o, d) for o, d in zip(outputs, launch.output_dtypes, strict=True)]
    return result, _counts(kernel, launch, raw)


def emulate_race_checked(launch: KernelLaunch) -> list[mx.array]:
    """Run in both thread orders; different bits mean the kernel's result depends on scheduling."""
    first = emulate(launch)
    second = emulate(launch, reverse=True)
    for name, a, b in zip(launch.output_names, first, second, strict=True):
        if not np.array_equal(to_numpy(a).view(np.uint8), to_numpy(b).view(np.uint8)):
            raise EmulatorError(
                f"{launch.name}: output {name!r} depends on thread order (a data race, "
                "e.g. a missing threadgroup_barrier)"
            )
    return first
