"""What the machine has: its memory as MLX sees it (unified memory on a Mac) and what other programs leave
free now. The pool planner (kvcache/plan.py) turns these into a budget."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from metalserve.kvcache.plan import MachineMemory
from metalserve.platform import current_platform


def total_memory_bytes() -> int:
    """The machine's memory as MLX sees it (unified memory on a Mac), else the OS's physical memory."""
    metal = current_platform().metal_memory
    return metal if metal is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_meminfo(text: str) -> int | None:
    """Linux: MemAvailable (free memory plus what the kernel can reclaim), in bytes."""
    match = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def parse_vm_stat(text: str) -> int | None:
    """macOS: free, inactive, speculative and purgeable pages from `vm_stat`, in bytes."""
    size = re.search(r"page size of (\d+) bytes", text)
    if size is None:
        return None
    kinds = ("Pages free", "Pages inactive", "Pages speculative", "Pages purgeable")
    pages = 0
    for kind in kinds:
        match = re.search(rf"^{kind}:\s+(\d+)", text, re.MULTILINE)
        pages += int(match.group(1)) if match else 0
    return pages * int(size.group(1))


def available_memory_bytes() -> int | None:
    """Memory other programs leave free right now; None where it cannot be read."""
    try:
        if sys.platform == "darwin":
            return parse_vm_stat(subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout)
        with open("/proc/meminfo") as f:
            return parse_meminfo(f.read())
    except (OSError, subprocess.SubprocessError):
        return None


def machine_memory(held: int) -> MachineMemory:
    """The machine's memory now; `held`: what this process holds already."""
    return MachineMemory(total_memory_bytes(), available_memory_bytes(), held)
