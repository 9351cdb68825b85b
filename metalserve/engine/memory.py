"""How much memory the KV cache may take: a share of memory that is really free, less the weights and a
full step; and no more than the running requests can use."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from metalserve.kvcache.block_pool import NUM_RESERVED_BLOCKS
from metalserve.platform import current_platform
from metalserve.units import format_bytes

# The pool starts this small and doubles as it fills (metalserve/kvcache/block_pool.py).
INITIAL_POOL_BLOCKS = 256


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


def memory_limit(utilization: float, total: int, available: int | None, held: int) -> tuple[int, str]:
    """The bytes the server may use, and why: its share of total memory, unless less is free.

    `held` is what this process already holds (the loaded weights), which `available` no longer counts."""
    share = int(total * utilization)
    why = f"{100 * utilization:.0f}% of {format_bytes(total)}"
    if available is not None and available + held < share:
        return available + held, f"{format_bytes(available)} available + {format_bytes(held)} held (less than {why})"
    return share, why


def pool_block_cap(
    max_num_seqs: int, max_model_len: int, block_size: int, blocks_per_request: int | None = None
) -> int:
    """More blocks than `max_num_seqs` requests of `max_model_len` tokens can never be in use at once.
    `blocks_per_request`: what one such request holds over all layer groups (default: one group's)."""
    per_request = -(-max_model_len // block_size) if blocks_per_request is None else blocks_per_request
    return max_num_seqs * per_request + NUM_RESERVED_BLOCKS
