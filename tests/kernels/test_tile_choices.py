"""tools/tile_choices.py: the tile table the Mac CI job uploads is the tiling the kernel launches with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from metalserve.kernels.metal.paged import HEAD_DIMS
from metalserve.kernels.metal.tiled import THREADGROUP_MEMORY, max_rows, tiling
from tools.tile_choices import GROUPS, report

ROOT = Path(__file__).resolve().parents[2]


def test_every_head_dim_and_group_has_the_kernels_tiling() -> None:
    rows = report()["tiles"]
    assert [(r["head_dim"], r["group"]) for r in rows] == [(d, g) for d in HEAD_DIMS for g in GROUPS]
    for r in rows:
        t = tiling(r["group"], r["head_dim"])
        if t is None:
            assert r["tile_q"] is None and r["threads"] is None
            continue
        assert (r["tile_q"], r["rows"], r["key_tile"], r["threads"]) == (t.tile_q, t.rows, t.key_tile, t.threads)
        assert r["threads"] <= 4 * max_rows(r["head_dim"]) and r["threadgroup_bytes"] <= THREADGROUP_MEMORY


def test_groups_beyond_the_row_limit_have_no_tile() -> None:
    by_key = {(r["head_dim"], r["group"]): r for r in report()["tiles"]}
    assert by_key[(64, 1)]["tile_q"] == 64 and by_key[(64, 128)]["tile_q"] == 1
    assert by_key[(256, 128)]["tile_q"] is None  # 128 rows do not fit head dim 256's limit of 64


def test_the_script_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "tile_choices.json"
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "tile_choices.py"), "--out", str(out)],
        check=True,
        cwd=ROOT,
        capture_output=True,
        timeout=120,
    )
    written = json.loads(out.read_text())
    assert written["tiles"] == report()["tiles"]
    assert written["device"] is None or "device_name" in written["device"]
