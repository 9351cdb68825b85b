"""GET /debug/memory: the process's resident memory split by component, for operators and bench/soak.py.

Weights and the KV pool come from the engine core (the pool as grown so far), the grammar cache and the
Responses store from their own byte counts, `mlx_cache` from MLX (freed buffers kept for reuse, handed
back when the engine goes idle); "other" is what the resident set holds beyond them (Python objects,
allocator slack, llguidance's lexer tables).
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

from metalserve.api.responses.store import ResponseStore


def process_rss() -> int:
    """Resident bytes now (Linux: /proc); elsewhere the peak, which is all getrusage gives."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


def memory_report(engines: list[Any], store: ResponseStore) -> dict[str, int]:
    """Every loaded model's weights, KV pool and grammar cache together (one model: its own)."""
    parts = {"weights": 0, "kv_pool": 0, "mlx_cache": 0, "grammar_cache": 0}
    for engine in engines:
        report = getattr(engine.core, "memory_report", None)
        for key, value in (report() if callable(report) else {}).items():
            # MLX's buffer cache is the process's, reported alike by every engine: counted once.
            parts[key] = max(parts.get(key, 0), value) if key == "mlx_cache" else parts.get(key, 0) + value
        compiler = getattr(engine, "_grammar", None)
        parts["grammar_cache"] += compiler.cache_bytes if compiler is not None else 0
    parts["responses_store"] = store.num_bytes
    rss = process_rss()
    parts["other"] = max(0, rss - sum(parts.values()))
    parts["rss"] = rss
    return parts
