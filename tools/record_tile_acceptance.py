"""Run on a Mac: which tiled-kernel threadgroups the GPU accepts, per dtype, head dim and thread count.

    python tools/record_tile_acceptance.py [--out tests/kernels/data/mac_tiles.json]

Each tile (512, 256 and 128 threads, for G 1, 4 and 8) is launched once through the launch guard
(metalserve/kernels/metal/guard.py), which evaluates it and records MLX's error if the pipeline refuses
it. The table shows whether the tiles the server picks (kernels/metal/tiled.py) are within what the GPU
took; commit the JSON with the Mac's name so the next change to the tiling can be checked against it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from metalserve.kernels.metal.guard import Executor, LaunchGuard, LaunchRefused  # noqa: E402
from metalserve.kernels.metal.paged import HEAD_DIMS, PagedArgs  # noqa: E402
from metalserve.kernels.metal.tiled import max_threads, tiled_launch, tiling  # noqa: E402

DEFAULT_OUT = ROOT / "tests" / "kernels" / "data" / "mac_tiles.json"
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
THREADS = (512, 256, 128)
GROUPS = (1, 4, 8)


def _args(group: int, head_dim: int, dtype: mx.Dtype, tile_q: int) -> PagedArgs:
    """One request of two tiles' worth of query tokens over a 64-token context, one KV head."""
    q_len, block = 2 * tile_q, 16
    q = mx.random.normal((q_len, group, head_dim)).astype(dtype)
    pool = mx.random.normal((128, 1, head_dim)).astype(dtype)
    tables = mx.arange(8, dtype=mx.int32)[None]
    return PagedArgs(
        q,
        pool,
        pool,
        tables,
        mx.array([0, q_len], mx.int32),
        mx.array([64], mx.int32),
        block,
        head_dim**-0.5,
        None,
        None,
        None,
    )


def probe(execute: Executor) -> list[dict[str, Any]]:
    """One row per (dtype, head dim, G, threads): accepted or the device's error, and whether the server
    would launch that many threads at that head dim."""
    rows = []
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            for group in GROUPS:
                for threads in THREADS:
                    t = tiling(group, head_dim, threads // 4)
                    if t is None or t.threads != threads:
                        continue
                    row: dict[str, Any] = dict(
                        dtype=str(dtype).removeprefix("mlx.core."),
                        head_dim=head_dim,
                        group=group,
                        threads=threads,
                        rows=t.rows,
                        key_tile=t.key_tile,
                        planned=threads <= max_threads(head_dim),
                    )
                    try:
                        LaunchGuard(execute)(tiled_launch(_args(group, head_dim, dtype, t.tile_q), t))
                        row["accepted"] = True
                    except LaunchRefused as refused:
                        row["accepted"], row["error"] = False, str(refused)
                    rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out = parser.parse_args().out
    if not mx.metal.is_available():
        raise SystemExit("no Metal device: run this on an Apple-silicon Mac")
    from metalserve.kernels.metal.gpu import run_metal

    rows = probe(run_metal)
    print(f"{'dtype':9} {'D':>4} {'G':>2} {'threads':>7} {'BK':>3}  planned  accepted")
    for r in rows:
        print(
            f"{r['dtype']:9} {r['head_dim']:4} {r['group']:2} {r['threads']:7} {r['key_tile']:3}  "
            f"{'yes' if r['planned'] else 'no':7}  {'yes' if r['accepted'] else 'NO: ' + r['error']}"
        )
    bad = [r for r in rows if r["planned"] and not r["accepted"]]
    device = {"machine": platform.platform(), "device": {k: str(v) for k, v in mx.metal.device_info().items()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**device, "tiles": rows}, indent=1))
    print(f"wrote {out}; {len(bad)} planned tile(s) refused" + (" (the server falls back for them)" if bad else ""))


if __name__ == "__main__":
    main()
