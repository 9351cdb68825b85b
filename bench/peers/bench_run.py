"""Run `metalserve bench serve` in-process against one server and return its JSON result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from metalserve.benchmarks.serve import main as bench_main

RESULTS = Path(__file__).resolve().parents[1] / "results"


def run_bench(base_url: str, result_file: Path, args: list[str], extra_body: dict[str, Any]) -> dict[str, Any]:
    """`args` are bench-serve flags; raises RuntimeError when the client itself fails (bad flags)."""
    argv = ["--base-url", base_url, "--result-file", str(result_file), "--save-detailed", *args]
    if extra_body:
        argv += ["--extra-body", json.dumps(extra_body)]
    rc = bench_main(argv)
    if rc == 2 or not result_file.exists():
        raise RuntimeError(f"bench serve failed (exit {rc}) with {' '.join(argv)}")
    doc: dict[str, Any] = json.loads(result_file.read_text(encoding="utf-8"))
    return doc
