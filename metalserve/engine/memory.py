"""How much memory the KV cache may take: the budget minus what the weights and a full step use."""

from __future__ import annotations

import os

import mlx.core as mx


def total_memory_bytes() -> int:
    """The machine's memory as MLX sees it (unified memory on a Mac), else the OS's physical memory."""
    if mx.metal.is_available():
        return int(mx.device_info()["memory_size"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_budget_bytes(utilization: float, measured_peak_bytes: int, total_bytes: int | None = None) -> int:
    """The share of memory the server may use, less the weights + activations peak of a warm-up step."""
    total = total_memory_bytes() if total_bytes is None else total_bytes
    return int(total * utilization) - measured_peak_bytes


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
