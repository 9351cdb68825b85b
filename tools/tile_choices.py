"""Write the tiled Metal kernel's tile sizes for every head dim and query-head group, with the device.

    python tools/tile_choices.py [--out tile_choices.json]

The sizes depend on shapes only (metalserve/kernels/metal/tiled.py), so they are the same on every machine;
the Mac CI job uploads them next to the device's description and the kernels' recorded outputs, so a
failure on a GPU can be read against the threadgroup sizes it launched.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from metalserve.kernels.metal.paged import HEAD_DIMS  # noqa: E402
from metalserve.kernels.metal.tiled import THREADGROUP_MEMORY, threadgroup_bytes, tiling  # noqa: E402

GROUPS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64, 128)  # query heads per KV head


def tile_rows() -> list[dict[str, Any]]:
    """One row per (head dim, group): the tiling, or `None` fields where no tile fits."""
    rows: list[dict[str, Any]] = []
    for head_dim in HEAD_DIMS:
        for group in GROUPS:
            t = tiling(group, head_dim)
            row: dict[str, Any] = {"head_dim": head_dim, "group": group}
            if t is None:
                row.update(tile_q=None, rows=None, key_tile=None, threads=None, threadgroup_bytes=None)
            else:
                row.update(
                    tile_q=t.tile_q,
                    rows=t.rows,
                    key_tile=t.key_tile,
                    threads=t.threads,
                    threadgroup_bytes=threadgroup_bytes(head_dim, t.rows, t.key_tile),
                )
            rows.append(row)
    return rows


def device() -> dict[str, Any] | None:
    """The Metal device's description, or None where MLX sees none."""
    if not mx.metal.is_available():
        return None
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in mx.metal.device_info().items()}


def report() -> dict[str, Any]:
    return {
        "mlx": getattr(mx, "__version__", "?"),
        "device": device(),
        "threadgroup_memory_limit": THREADGROUP_MEMORY,
        "tiles": tile_rows(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="a JSON file (default: print)")
    text = json.dumps(report(), indent=1)
    out = parser.parse_args().out
    if out is None:
        print(text)
    else:
        out.write_text(text + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
